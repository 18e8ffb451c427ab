"""The Triton paged attention kernels, decode and prefill (ops/triton_attention.py), and the
TRITON_PAGED backend, checked against the torch reference (ops/paged_attention.py) under the Triton interpreter, on CPU.

Why a subprocess: triton reads TRITON_INTERPRET when a kernel is decorated (`@triton.jit`, at import of
the kernel module), not per launch, so the variable must be set before the module is imported, and
setting it in this process would turn every kernel imported later in the session into an interpreted
one. So this file runs itself as a script, once per session, with the variable set in the child's
environment only; the child runs every check and reports each one's outcome as JSON, and each test
here asserts on its own check. On the GPU machine the same checks run compiled (no variable set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KV_HEADS, HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 4, 32, 16, 24
SEQ_LENS = [5, 16, 70]  # part of a block, exactly one block, five blocks (three splits of two)


@pytest.fixture(scope="module")
def checks() -> dict[str, str | None]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    if "TRITON_INTERPRET" in os.environ and os.environ["TRITON_INTERPRET"] != "1":
        pytest.fail("TRITON_INTERPRET is set to something else than 1 in this session's environment")
    done = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    if done.returncode != 0:
        pytest.fail(f"the check script failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _outcome(checks: dict[str, str | None], name: str) -> None:
    assert name in checks, f"check {name!r} did not run; ran: {sorted(checks)}"
    if checks[name] is not None:
        pytest.fail(f"check {name!r} failed in the interpreter subprocess:\n{checks[name]}")


def test_fp32_decode_matches_the_torch_reference_across_blocks_splits_and_gqa(checks):
    _outcome(checks, "fp32_splits")


def test_the_split_size_does_not_change_the_result(checks):
    """One block per split, the default choice, and one split for the whole context."""
    _outcome(checks, "split_sizes")


def test_padded_head_groups_and_head_dims_are_masked(checks):
    """GQA 3:1 (the group is padded to 4 heads) with head_dim 24 (padded to 32), and plain MHA."""
    _outcome(checks, "padded_shapes")


def test_slots_past_the_context_are_never_read(checks):
    """The cache is NaN everywhere but the context's slots: any stray read would poison the output."""
    _outcome(checks, "no_stray_reads")


def test_half_precision_caches_match_within_1e_2(checks):
    _outcome(checks, "fp16")
    _outcome(checks, "bf16")


def test_prefill_matches_the_torch_reference_for_prompts_chunks_and_decodes(checks):
    """A whole prompt, a chunk after a cached prefix, a decode, and a prompt longer than one query tile,
    in one batch; fp32 at 1e-5, and the same batch with a NaN cache outside the context."""
    _outcome(checks, "prefill_fp32")
    _outcome(checks, "prefill_no_stray_reads")


def test_prefill_in_half_precision_matches_within_1e_2(checks):
    _outcome(checks, "prefill_fp16")
    _outcome(checks, "prefill_bf16")


def test_bad_shapes_are_refused_with_what_to_do(checks):
    _outcome(checks, "errors")


def test_the_triton_backend_matches_the_torch_backend_on_decode_and_mixed_steps(checks):
    """Decode-only steps go through the split-K kernel, a step with a prompt through the prefill kernel;
    both store this step's keys and values in the cache as the torch backend does."""
    _outcome(checks, "backend")


# -- the child: runs with TRITON_INTERPRET=1 ---------------------------------------------------------------


def _case(torch, dtype, seq_lens, *, kv_heads=KV_HEADS, heads=HEADS, head_dim=HEAD_DIM, nan_cache=False):
    """Random caches with each sequence's blocks scattered over the pool, and one query per sequence."""
    gen = torch.Generator().manual_seed(len(seq_lens) * 1000 + sum(seq_lens) + head_dim)
    key_cache = torch.randn(kv_heads, NUM_BLOCKS, BLOCK_SIZE, head_dim, generator=gen)
    value_cache = torch.randn(kv_heads, NUM_BLOCKS, BLOCK_SIZE, head_dim, generator=gen)
    query = torch.randn(len(seq_lens), heads, head_dim, generator=gen)
    pool = torch.randperm(NUM_BLOCKS, generator=gen)
    max_blocks = max(-(-n // BLOCK_SIZE) for n in seq_lens) + 1  # a spare column: tables are padded
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int64)
    used = 0
    for row, n in enumerate(seq_lens):
        blocks = -(-n // BLOCK_SIZE)
        block_tables[row, :blocks] = pool[used : used + blocks]
        used += blocks
    if nan_cache:
        valid = torch.zeros(kv_heads, NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bool)
        for row, n in enumerate(seq_lens):
            for position in range(n):
                valid[:, block_tables[row, position // BLOCK_SIZE], position % BLOCK_SIZE] = True
        clean = (key_cache.clone(), value_cache.clone())
        key_cache[~valid] = float("nan")
        value_cache[~valid] = float("nan")
        return query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), block_tables, clean
    return query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), block_tables, None


def _reference(torch, query, key_cache, value_cache, block_tables, seq_lens):
    from asyncengine.ops.paged_attention import paged_attention, plan_attention

    plan = plan_attention([1] * len(seq_lens), seq_lens, block_tables, BLOCK_SIZE)
    return paged_attention(query.float(), key_cache.float(), value_cache.float(), plan, query.shape[-1] ** -0.5)


def _run(torch, query, key_cache, value_cache, block_tables, seq_lens, **options):
    from asyncengine.ops.triton_attention import paged_decode_attention

    out = torch.full_like(query, float("nan"))  # poisoned: a row the kernel skips stays NaN
    returned = paged_decode_attention(query, key_cache, value_cache, block_tables,
                                      torch.tensor(seq_lens, dtype=torch.int32), query.shape[-1] ** -0.5,
                                      out=out, **options)
    if returned is not out:
        raise AssertionError("paged_decode_attention did not return the `out` it filled")
    return out


def _check_fp32_splits(torch):
    case = _case(torch, torch.float32, SEQ_LENS)
    out = _run(torch, *case[:4], SEQ_LENS, blocks_per_split=2)
    torch.testing.assert_close(out, _reference(torch, *case[:4], SEQ_LENS), rtol=1e-5, atol=1e-5)


def _check_split_sizes(torch):
    case = _case(torch, torch.float32, SEQ_LENS)
    expected = _reference(torch, *case[:4], SEQ_LENS)
    for options in ({"blocks_per_split": 1}, {}, {"blocks_per_split": 64}):
        torch.testing.assert_close(_run(torch, *case[:4], SEQ_LENS, **options), expected, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, o=options: f"{o}: {m}")


def _check_padded_shapes(torch):
    for kv_heads, heads, head_dim in ((2, 6, 24), (3, 3, 32)):
        seq_lens = [33, 1, 17]
        case = _case(torch, torch.float32, seq_lens, kv_heads=kv_heads, heads=heads, head_dim=head_dim)
        torch.testing.assert_close(_run(torch, *case[:4], seq_lens, blocks_per_split=1),
                                   _reference(torch, *case[:4], seq_lens), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, s=(kv_heads, heads, head_dim): f"kv/heads/dim {s}: {m}")


def _check_no_stray_reads(torch):
    query, key_cache, value_cache, block_tables, clean = _case(torch, torch.float32, SEQ_LENS, nan_cache=True)
    out = _run(torch, query, key_cache, value_cache, block_tables, SEQ_LENS, blocks_per_split=2)
    torch.testing.assert_close(out, _reference(torch, query, *clean, block_tables, SEQ_LENS), rtol=1e-5, atol=1e-5)


def _check_half(torch, dtype):
    case = _case(torch, dtype, SEQ_LENS)
    out = _run(torch, *case[:4], SEQ_LENS, blocks_per_split=2)
    if out.dtype != dtype:
        raise AssertionError(f"output dtype {out.dtype}, expected the query's {dtype}")
    torch.testing.assert_close(out.float(), _reference(torch, *case[:4], SEQ_LENS), rtol=1e-2, atol=1e-2)


PREFILL_QUERY_LENS, PREFILL_SEQ_LENS = [20, 9, 1, 40], [20, 37, 50, 40]


def _run_prefill(torch, query, key_cache, value_cache, block_tables):
    from asyncengine.ops.triton_attention import paged_prefill_attention

    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(query, key_cache, value_cache, block_tables, PREFILL_QUERY_LENS, PREFILL_SEQ_LENS,
                            query.shape[-1] ** -0.5, out=out)
    return out


def _prefill_reference(torch, query, key_cache, value_cache, block_tables):
    from asyncengine.ops.paged_attention import paged_attention, plan_attention

    plan = plan_attention(PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, block_tables, BLOCK_SIZE)
    return paged_attention(query.float(), key_cache.float(), value_cache.float(), plan, query.shape[-1] ** -0.5)


def _prefill_case(torch, dtype, nan_cache=False):
    query, key_cache, value_cache, block_tables, clean = _case(torch, dtype, PREFILL_SEQ_LENS, nan_cache=nan_cache)
    gen = torch.Generator().manual_seed(11)
    query = torch.randn(sum(PREFILL_QUERY_LENS), HEADS, HEAD_DIM, generator=gen).to(dtype)
    return query, key_cache, value_cache, block_tables, clean


def _check_prefill(torch, dtype, tolerance):
    query, key_cache, value_cache, block_tables, _ = _prefill_case(torch, dtype)
    out = _run_prefill(torch, query, key_cache, value_cache, block_tables)
    if out.dtype != dtype:
        raise AssertionError(f"output dtype {out.dtype}, expected the query's {dtype}")
    torch.testing.assert_close(out.float(), _prefill_reference(torch, query, key_cache, value_cache, block_tables),
                               rtol=tolerance, atol=tolerance)


def _check_prefill_no_stray_reads(torch):
    query, key_cache, value_cache, block_tables, clean = _prefill_case(torch, torch.float32, nan_cache=True)
    out = _run_prefill(torch, query, key_cache, value_cache, block_tables)
    torch.testing.assert_close(out, _prefill_reference(torch, query, *clean, block_tables), rtol=1e-5, atol=1e-5)


def _check_errors(torch):
    from asyncengine.ops.triton_attention import paged_decode_attention

    query, key_cache, value_cache, block_tables, _ = _case(torch, torch.float32, SEQ_LENS)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    bad = [
        ((query[:, :3], key_cache, value_cache, block_tables, lens), "not a multiple of 2 KV heads"),
        ((query, key_cache[:, :, :12], value_cache[:, :, :12], block_tables, lens), "block size 12 is not a power"),
        ((query, key_cache, value_cache[..., :16], block_tables, lens), "disagree"),
        ((query, key_cache, value_cache, block_tables, lens[:2]), "3 queries, but seq_lens (2,)"),
    ]
    from asyncengine.ops.triton_attention import paged_prefill_attention

    try:
        paged_prefill_attention(query, key_cache, value_cache, block_tables, [1, 1, 2], SEQ_LENS, 1.0)
    except ValueError as error:
        if "summing to 4" not in str(error):
            raise AssertionError(f"expected the row count in the error, got: {error}") from error
    else:
        raise AssertionError("no error for query_lens that do not cover the query rows")
    for args, message in bad:
        try:
            paged_decode_attention(*args, 1.0)
        except ValueError as error:
            if message not in str(error):
                raise AssertionError(f"expected {message!r} in the error, got: {error}") from error
        else:
            raise AssertionError(f"no error for a call that should say {message!r}")


def _check_backend(torch):
    from asyncengine.attention.torch_paged import TorchPagedBackend
    from asyncengine.attention.triton_paged import TritonPagedBackend
    from asyncengine.models.layers.attention import AttentionMetadata
    from asyncengine.ops.paged_attention import plan_attention

    gen = torch.Generator().manual_seed(7)
    # Step 1 is mixed (a prompt of 20 tokens and a decode at context 40), step 2 decode only (41 and 21).
    block_tables = torch.tensor([[3, 9, 1, 0], [5, 2, 0, 0]], dtype=torch.int64)
    caches = {}
    for name in ("torch", "triton"):
        shape = (KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM)
        caches[name] = (torch.zeros(shape), torch.zeros(shape))
    # A prefix of 39 tokens for sequence 0, already in both caches.
    prefix_k = torch.randn(KV_HEADS, 39, HEAD_DIM, generator=gen)
    prefix_v = torch.randn(KV_HEADS, 39, HEAD_DIM, generator=gen)
    prefix_slots = torch.tensor([block_tables[0, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(39)])
    for key_cache, value_cache in caches.values():
        key_cache.view(KV_HEADS, -1, HEAD_DIM)[:, prefix_slots] = prefix_k
        value_cache.view(KV_HEADS, -1, HEAD_DIM)[:, prefix_slots] = prefix_v
    steps = [([1, 20], [40, 20]), ([1, 1], [41, 21])]
    backends = {"torch": TorchPagedBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5),
                "triton": TritonPagedBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)}
    for query_lens, seq_lens in steps:
        tokens = sum(query_lens)
        slots = []
        for row, (q, n) in enumerate(zip(query_lens, seq_lens)):
            slots += [int(block_tables[row, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n - q, n)]
        plan = plan_attention(query_lens, seq_lens, block_tables, BLOCK_SIZE)
        metadata = AttentionMetadata(torch.tensor(slots), plan, query_lens, seq_lens, block_tables)
        query = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
        key = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
        value = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
        outs = {name: backend.forward(query, key, value, caches[name], metadata) for name, backend in backends.items()}
        torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, s=query_lens: f"step with query_lens {s}: {m}")
        torch.testing.assert_close(caches["triton"][0], caches["torch"][0], rtol=0, atol=0)
        torch.testing.assert_close(caches["triton"][1], caches["torch"][1], rtol=0, atol=0)


def _child() -> None:
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run by the tests with TRITON_INTERPRET=1 in the environment")
    checks = {
        "fp32_splits": _check_fp32_splits,
        "split_sizes": _check_split_sizes,
        "padded_shapes": _check_padded_shapes,
        "no_stray_reads": _check_no_stray_reads,
        "fp16": lambda t: _check_half(t, t.float16),
        "bf16": lambda t: _check_half(t, t.bfloat16),
        "prefill_fp32": lambda t: _check_prefill(t, t.float32, 1e-5),
        "prefill_no_stray_reads": _check_prefill_no_stray_reads,
        "prefill_fp16": lambda t: _check_prefill(t, t.float16, 1e-2),
        "prefill_bf16": lambda t: _check_prefill(t, t.bfloat16, 1e-2),
        "errors": _check_errors,
        "backend": _check_backend,
    }
    results: dict[str, str | None] = {}
    for name, check in checks.items():
        try:
            check(torch)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported to the parent, whose test for this check fails with it
            results[name] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _child()
