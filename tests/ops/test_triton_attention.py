"""The Triton paged attention kernels, decode and prefill (ops/triton_attention.py), and the
TRITON_PAGED backend, checked against the torch reference (ops/paged_attention.py).

Where they run. By default on CPU under the Triton interpreter. With ASYNCENGINE_KERNEL_DEVICE=cuda in
the environment (how bench/gpu.py runs this file on the GPU machine) the same checks run compiled, on
CUDA tensors; a few checks only mean something there (host syncs, CUDA-graph capture) and are skipped
on CPU. Every tensor of the checks is made through `dev` (attention_cases.py: drawn on CPU, then moved),
and the references run on CPU in fp32, so TF32 cannot creep into them.

Why a subprocess: triton reads TRITON_INTERPRET when a kernel is decorated (`@triton.jit`, at import of
the kernel module), not per launch, so the variable must be set before the module is imported, and
setting it in this process would turn every kernel imported later in the session into an interpreted
one. So this file runs itself as a script, once per session, with the variable set (or, for CUDA,
removed) in the child's environment only; the child runs every check and reports each one's outcome as
JSON, and each test here asserts on its own check. Outputs are NaN-poisoned before every kernel run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
from attention_cases import (
    BLOCK_SIZE, DEVICE, DEVICE_VARIABLE, HEAD_DIM, HEADS, KV_HEADS, NUM_BLOCKS, PREFILL_QUERY_LENS, PREFILL_SEQ_LENS,
    SEQ_LENS, close, decode_reference, dev, expect_error, make_case, prefill_case, prefill_inputs, reference,
    run_decode, run_prefill,
)

REPO = Path(__file__).resolve().parents[2]
SKIPPED = "skipped: "  # a check's outcome that starts so is a skip, with its reason


@pytest.fixture(scope="module")
def checks() -> dict[str, str | None]:
    device = os.environ.get(DEVICE_VARIABLE, "cpu")
    if device == "cuda":
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    elif device == "cpu":
        if os.environ.get("TRITON_INTERPRET", "1") != "1":
            pytest.fail("TRITON_INTERPRET is set to something else than 1 in this session's environment")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
    else:
        pytest.fail(f"{DEVICE_VARIABLE}={device!r}: set it to 'cuda' (compiled, on the GPU) or leave it unset (CPU)")
    done = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)
    if done.returncode != 0:
        pytest.fail(f"the check script failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _outcome(checks: dict[str, str | None], name: str) -> None:
    assert name in checks, f"check {name!r} did not run; ran: {sorted(checks)}"
    outcome = checks[name]
    if outcome is not None and outcome.startswith(SKIPPED):
        pytest.skip(outcome.removeprefix(SKIPPED))
    if outcome is not None:
        pytest.fail(f"check {name!r} failed in the kernel subprocess:\n{outcome}")


def test_fp32_decode_matches_the_torch_reference_across_blocks_splits_and_gqa(checks):
    _outcome(checks, "fp32_splits")


def test_the_split_size_does_not_change_the_result(checks):
    """One block per split, the default choice, and one split for the whole context."""
    _outcome(checks, "split_sizes")


def test_padded_head_groups_and_head_dims_are_masked(checks):
    """GQA 3:1 (the group is padded to 4 heads) with head_dim 24 (padded to 32), plain MHA, and W1's shape,
    with a context past one tile."""
    _outcome(checks, "padded_shapes")


def test_decode_tiles_gather_scattered_blocks_and_mask_their_edges(checks):
    """Cache blocks of 8, 16 and 32 keys under the default tile (128 keys here) and smaller ones (two
    blocks, one block); contexts of exactly one tile, ending mid-tile and mid-block, on a block edge inside
    a tile, under one block; splits of whole tiles, of a tile and a half, and one split. The blocks lie
    scattered over a NaN cache, the table entries past each context point at a NaN block."""
    _outcome(checks, "decode_tiles")


def test_decode_tiles_are_whole_blocks_and_chosen_splits_whole_tiles(checks):
    """64 keys (four blocks of 16) at W1's shape; always a power of two of whole blocks, at most 128 keys
    unless a block is larger; `choose_blocks_per_split` gives a whole number of tiles."""
    _outcome(checks, "decode_tile_choice")


def test_slots_past_the_context_are_never_read(checks):
    """The cache is NaN everywhere but the context's slots: any stray read would poison the output."""
    _outcome(checks, "no_stray_reads")


def test_half_precision_caches_match_within_1e_2(checks):
    _outcome(checks, "fp16")
    _outcome(checks, "bf16")


def test_decode_padding_rows_of_seq_len_0_read_nothing_and_come_out_zero(checks):
    """Rows of seq_len 0 between real ones, their block-table rows pointing at NaN blocks, with one
    split and with many: zeros for them, the reference for the others."""
    _outcome(checks, "decode_padding_rows")
    _outcome(checks, "combine_all_empty")


def test_decode_without_max_seq_len_takes_its_grid_from_the_block_tables_width(checks):
    _outcome(checks, "decode_grid_from_shapes")


def test_prefill_matches_the_torch_reference_for_prompts_chunks_and_decodes(checks):
    """A whole prompt, a chunk after a cached prefix, a decode, and a prompt longer than one query tile,
    in one batch; fp32 at 1e-5, and the same batch with a NaN cache outside the context."""
    _outcome(checks, "prefill_fp32")
    _outcome(checks, "prefill_no_stray_reads")


def test_prefill_tile_sizes_and_cache_block_sizes_do_not_change_the_result(checks):
    """Query tiles of 8 and 32 tokens, key steps of 16 and 32 over cache blocks of 8, 16 and 32 (a key step
    spanning several cache blocks, or part of one), and a max_query_len above the longest query."""
    _outcome(checks, "prefill_tiles")


def test_prefill_chunks_after_every_prefix_length_mask_exactly_the_future(checks):
    """Prefixes 0..25 before a chunk: the causal edge falls at every offset within a key step."""
    _outcome(checks, "prefill_chunk_offsets")


def test_prefill_gqa_groups_and_padded_head_dims(checks):
    """GQA 2:1 and 3:1 (group padded to 4 rows a token), MHA, head_dim 24 and 8 (padded to 32 and 16)."""
    _outcome(checks, "prefill_gqa")


def test_prefill_at_the_w1_attention_shape(checks):
    """Qwen3-0.6B's attention: 16 query heads, 8 KV heads, head_dim 128; fp32 and bf16, default tiles."""
    _outcome(checks, "prefill_w1_fp32")
    _outcome(checks, "prefill_w1_bf16")


def test_prefill_in_half_precision_matches_within_1e_2(checks):
    _outcome(checks, "prefill_fp16")
    _outcome(checks, "prefill_bf16")


def test_neither_kernel_reads_device_values_back_to_the_host(checks):
    """Tensor-to-host conversions (item, tolist, int(), bool()) and torch.tensor raise during the calls; on
    CUDA, torch's sync debug mode is set to error as well."""
    _outcome(checks, "no_host_sync")


def test_decode_captured_in_a_cuda_graph_replays_with_new_inputs(checks):
    _outcome(checks, "cuda_graph_decode")


def test_bad_shapes_are_refused_with_what_to_do(checks):
    _outcome(checks, "errors")


def test_the_triton_backend_matches_the_torch_backend_on_decode_and_mixed_steps(checks):
    """Decode-only steps go through the split-K kernel, a step with a prompt through the prefill kernel;
    both store this step's keys and values in the cache as the torch backend does."""
    _outcome(checks, "backend")


# -- the child: runs with TRITON_INTERPRET=1 on CPU, or compiled on CUDA (cases in attention_cases.py) ----


def _check_fp32_splits(torch):
    case = make_case(torch, torch.float32, SEQ_LENS)
    close(torch, run_decode(torch, *case[:4], SEQ_LENS, blocks_per_split=2, max_seq_len=max(SEQ_LENS)),
           decode_reference(torch, case, SEQ_LENS), 1e-5)


def _check_split_sizes(torch):
    case = make_case(torch, torch.float32, SEQ_LENS)
    expected = decode_reference(torch, case, SEQ_LENS)
    for options in ({"blocks_per_split": 1}, {}, {"blocks_per_split": 64}, {"max_seq_len": 70}):
        close(torch, run_decode(torch, *case[:4], SEQ_LENS, **options), expected, 1e-5, str(options))


def _check_padded_shapes(torch):
    for kv_heads, heads, head_dim in ((2, 6, 24), (3, 3, 32), (8, 16, 128)):  # the last: Qwen3-0.6B's (W1)
        seq_lens = [33, 1, 130]  # 130: past one tile of the default size (64 or 128 keys here)
        case = make_case(torch, torch.float32, seq_lens, kv_heads=kv_heads, heads=heads, head_dim=head_dim)
        expected = decode_reference(torch, case, seq_lens)
        for options in ({"blocks_per_split": 3}, {}):  # 3: splits of 3 blocks, tiles of 4 or 8
            close(torch, run_decode(torch, *case[:4], seq_lens, **options), expected, 1e-5,
                  f"kv/heads/dim {(kv_heads, heads, head_dim)}, {options}")


def _check_decode_tiles(torch):
    from asyncengine.ops.triton_attention import decode_tile_tokens

    for block_size in (8, 16, 32):
        default = decode_tile_tokens(block_size, HEADS, KV_HEADS, HEAD_DIM)
        tiles = {default, 2 * block_size} | ({block_size} if block_size == 16 else set())
        for tile in sorted(tiles):
            tile_blocks = tile // block_size
            # Exactly one tile; two tiles and half a block (ends mid-tile and mid-block); a tile and a
            # block (ends on a block edge inside a tile); less than a block.
            seq_lens = [tile, 2 * tile + block_size // 2 + 1, tile + block_size, 3]
            num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
            query, key_cache, value_cache, tables, clean = make_case(
                torch, torch.float32, seq_lens, block_size=block_size, num_blocks=num_blocks, nan_cache=True)
            expected = reference(torch, query, *clean, tables, [1] * len(seq_lens), seq_lens)
            # Entries past each sequence's blocks point at a block that is NaN throughout: a read shows.
            unused = sorted(set(range(num_blocks)) - set(tables.cpu().flatten().tolist()))[0]
            for row, n in enumerate(seq_lens):
                tables[row, -(-n // block_size):] = unused
            splits = ({}, {"blocks_per_split": tile_blocks + max(1, tile_blocks // 2)}, {"blocks_per_split": 64})
            for options in splits:  # whole tiles (the choice), a tile and a half (or two blocks), one split
                out = run_decode(torch, query, key_cache, value_cache, tables, seq_lens, tile_tokens=tile, **options)
                close(torch, out, expected, 1e-5, f"block {block_size}, tile {tile}, seq_lens {seq_lens}, {options}")


def _check_decode_tile_choice(torch):
    from asyncengine.ops.triton_attention import choose_blocks_per_split, decode_tile_tokens

    if (w1 := decode_tile_tokens(16, 16, 8, 128)) != 64:
        raise AssertionError(f"W1's shape (block 16, 16 heads on 8 KV heads, head_dim 128): tile {w1}, expected 64")
    for block_size in (8, 16, 32, 64, 256):
        for heads, kv_heads in ((16, 8), (32, 4), (4, 4), (48, 1)):
            for head_dim in (24, 64, 128, 256):
                tile = decode_tile_tokens(block_size, heads, kv_heads, head_dim)
                if tile & (tile - 1) or tile % block_size or tile > max(block_size, 128):
                    raise AssertionError(f"tile {tile} for block {block_size}, heads {heads}/{kv_heads}, head_dim "
                                         f"{head_dim}: not a power of two of whole blocks up to 128 keys")
    for tile_blocks in (1, 4, 8):
        for num_seqs, max_blocks in ((1, 1), (1, 130), (3, 7), (256, 130)):
            blocks = choose_blocks_per_split(num_seqs, 8, max_blocks, tile_blocks=tile_blocks)
            if blocks % tile_blocks or blocks < 1:
                raise AssertionError(f"{blocks} blocks a split for tiles of {tile_blocks} ({num_seqs} seqs, "
                                     f"{max_blocks} blocks): not a whole number of tiles")


def _check_no_stray_reads(torch):
    query, key_cache, value_cache, block_tables, clean = make_case(torch, torch.float32, SEQ_LENS, nan_cache=True)
    out = run_decode(torch, query, key_cache, value_cache, block_tables, SEQ_LENS, blocks_per_split=2)
    close(torch, out, reference(torch, query, *clean, block_tables, [1] * 3, SEQ_LENS), 1e-5)


def _check_half(torch, dtype):
    case = make_case(torch, dtype, SEQ_LENS)
    out = run_decode(torch, *case[:4], SEQ_LENS, blocks_per_split=2)
    if out.dtype != dtype:
        raise AssertionError(f"output dtype {out.dtype}, expected the query's {dtype}")
    close(torch, out, decode_reference(torch, case, SEQ_LENS), 1e-2)


def _check_decode_padding_rows(torch):
    real = [5, 70, 17]
    query, key_cache, value_cache, block_tables, clean = make_case(torch, torch.float32, real, nan_cache=True)
    seq_lens = [5, 0, 70, 0, 17]  # padding rows 1 and 3, as a captured batch larger than the step has them
    rows = [0, 2, 4]
    # The padding rows' tables point at blocks that are NaN: a read would show. Block 23 holds no context.
    unused = sorted(set(range(NUM_BLOCKS)) - set(block_tables.cpu().flatten().tolist()))[0]
    tables = torch.full((5, block_tables.shape[1]), unused, dtype=block_tables.dtype, device=block_tables.device)
    tables[rows] = block_tables
    queries = dev(torch.randn(5, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3)))
    queries[rows] = query
    expected = reference(torch, query, *clean, block_tables, [1] * 3, real)
    for options in ({}, {"blocks_per_split": 1}, {"max_seq_len": 70, "blocks_per_split": 2}):
        out = run_decode(torch, queries, key_cache, value_cache, tables, seq_lens, **options)
        close(torch, out[rows], expected, 1e-5, f"real rows, {options}")
        if not bool((out[[1, 3]] == 0).all()):
            raise AssertionError(f"{options}: padding rows are not all zeros: {out[[1, 3]].flatten()[:8]}")


def _check_combine_all_empty(torch):
    """The split merge, kernel and torch reference, on a row with every split empty and a row with one."""
    from asyncengine.ops.triton_attention import _combine_kernel, _combine_splits

    partial_max = torch.tensor([[[float("-inf")] * 3], [[0.5, float("-inf"), 1.0]]])  # [2 seqs, 1 head, 3 splits]
    partial_sum = torch.tensor([[[0.0] * 3], [[2.0, 0.0, 1.0]]])
    partial_out = torch.zeros(2, 1, 3, 24)
    partial_out[1, 0, 0], partial_out[1, 0, 2] = 1.0, 3.0
    share = 2.0 * torch.exp(torch.tensor(-0.5))  # split 0's softmax mass relative to split 2's
    want = torch.stack([torch.zeros(1, 24), ((share * 1.0 + 3.0) / (share + 1.0)).expand(1, 24)])
    parts = (dev(partial_max), dev(partial_sum), dev(partial_out))
    torch.testing.assert_close(_combine_splits(*parts).cpu(), want, rtol=1e-6, atol=1e-6)
    out = dev(torch.full((2, 1, 24), float("nan")))
    _combine_kernel[(2, 1)](*parts, out, out.stride(0), out.stride(1), 1, 3, HEAD_DIM=24, HEAD_DIM_P=32)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-6, atol=1e-6)


class _GridRecorder:
    """Stands in for a kernel object to record the grid of each launch, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def _check_decode_grid_from_shapes(torch):
    from asyncengine.ops import triton_attention

    case = make_case(torch, torch.float32, SEQ_LENS)
    wide = torch.zeros(3, 12, dtype=case[3].dtype, device=case[3].device)  # 12 blocks: 192 slots, contexts <= 70
    wide[:, : case[3].shape[1]] = case[3]
    recorder = _GridRecorder(triton_attention._decode_split_kernel)
    triton_attention._decode_split_kernel = recorder
    try:
        out = run_decode(torch, case[0], case[1], case[2], wide, SEQ_LENS, blocks_per_split=2)
        out_bounded = run_decode(torch, case[0], case[1], case[2], wide, SEQ_LENS, blocks_per_split=2, max_seq_len=70)
    finally:
        triton_attention._decode_split_kernel = recorder.kernel
    expected = decode_reference(torch, case, SEQ_LENS)
    close(torch, out, expected, 1e-5, "max_seq_len None")
    close(torch, out_bounded, expected, 1e-5, "max_seq_len 70")
    # None: 12 blocks of the table / 2 a split = 6 splits; 70: 5 blocks = 3 splits.
    if recorder.grids != [(3, KV_HEADS, 6), (3, KV_HEADS, 3)]:
        raise AssertionError(f"grids {recorder.grids}, expected [(3, {KV_HEADS}, 6), (3, {KV_HEADS}, 3)]")



def _check_prefill(torch, dtype, tolerance, query_lens=PREFILL_QUERY_LENS, seq_lens=PREFILL_SEQ_LENS,
                   options=({"block_m": 16, "block_n": 16},), **shape):
    query, key_cache, value_cache, block_tables, _ = prefill_case(torch, dtype, query_lens, seq_lens, **shape)
    expected = reference(torch, query, key_cache, value_cache, block_tables, query_lens, seq_lens)
    for option in options:
        out = run_prefill(torch, query, key_cache, value_cache, block_tables, query_lens, seq_lens, **option)
        if out.dtype != dtype:
            raise AssertionError(f"output dtype {out.dtype}, expected the query's {dtype}")
        close(torch, out, expected, tolerance, f"{shape} {option}")


def _check_prefill_no_stray_reads(torch):
    query, key_cache, value_cache, block_tables, clean = prefill_case(torch, torch.float32, nan_cache=True)
    expected = reference(torch, query, *clean, block_tables, PREFILL_QUERY_LENS, PREFILL_SEQ_LENS)
    for option in ({"block_m": 16, "block_n": 16}, {"block_m": 16, "block_n": 32}, {}):
        close(torch, run_prefill(torch, query, key_cache, value_cache, block_tables, **option), expected, 1e-5,
               str(option))


def _check_prefill_tiles(torch):
    # block_m 16 with a group of 2: 8 query tokens a tile, so the 40-token prompt spans 5 tiles.
    options = ({"block_m": 16, "block_n": 16}, {"block_m": 16, "block_n": 32}, {"block_m": 64, "block_n": 16},
               {"block_m": 16, "block_n": 16, "max_query_len": 57})
    for block_size, num_blocks in ((16, 24), (8, 48), (32, 12)):
        _check_prefill(torch, torch.float32, 1e-5, options=options if block_size == 16 else options[:2],
                       block_size=block_size, num_blocks=num_blocks)


def _check_prefill_chunk_offsets(torch):
    # A chunk of 11 tokens after every prefix length 0..25: the tiles (8 tokens) start at every position
    # modulo the key steps (16, 32), so each edge between unmasked and masked key steps, and the tile's
    # last key step, is met at every offset.
    contexts = range(26)
    query_lens, seq_lens = [11] * len(contexts), [context + 11 for context in contexts]
    options = ({"block_m": 16, "block_n": 16}, {"block_m": 16, "block_n": 32})
    _check_prefill(torch, torch.float32, 1e-5, query_lens, seq_lens, options=options, num_blocks=3 * len(contexts))


def _check_prefill_gqa(torch):
    query_lens, seq_lens = [19, 6, 1], [19, 30, 9]
    for kv_heads, heads, head_dim in ((2, 4, 24), (2, 6, 32), (3, 3, 24), (1, 3, 8)):
        _check_prefill(torch, torch.float32, 1e-5, query_lens, seq_lens, kv_heads=kv_heads, heads=heads,
                       head_dim=head_dim, options=({"block_m": 16, "block_n": 16},))


def _check_prefill_w1(torch, dtype, tolerance):
    # Few tokens: the interpreter is slow at this size. A prompt, a chunk after a prefix, a decode.
    _check_prefill(torch, dtype, tolerance, [12, 3, 1], [12, 20, 17], options=({},),
                   kv_heads=8, heads=16, head_dim=128, num_blocks=6)


def _check_no_host_sync(torch):
    from asyncengine.ops.triton_attention import paged_decode_attention, paged_prefill_attention

    case = prefill_case(torch, torch.float32)
    query_start_loc, lens = prefill_inputs(torch, PREFILL_QUERY_LENS, PREFILL_SEQ_LENS)
    decode = make_case(torch, torch.float32, SEQ_LENS)
    decode_lens = dev(torch.tensor(SEQ_LENS, dtype=torch.int32))
    expected = (reference(torch, *case[:4], PREFILL_QUERY_LENS, PREFILL_SEQ_LENS),
                decode_reference(torch, decode, SEQ_LENS))

    def refuse(name):
        def refused(*_args, **_kwargs):
            raise AssertionError(f"{name} was called inside the kernel wrapper: a host sync")
        return refused

    patched = {(torch.Tensor, name): getattr(torch.Tensor, name)
               for name in ("item", "tolist", "__int__", "__index__", "__bool__", "__float__")}
    patched[(torch, "tensor")] = torch.tensor
    prefill_out = torch.full_like(case[0], float("nan"))
    decode_out = torch.full_like(decode[0], float("nan"))
    for (owner, name) in patched:
        setattr(owner, name, refuse(name))
    if DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        paged_prefill_attention(*case[:4], query_start_loc, lens, HEAD_DIM**-0.5, max_query_len=40, out=prefill_out)
        paged_decode_attention(*decode[:4], decode_lens, HEAD_DIM**-0.5, out=decode_out, blocks_per_split=1)
    finally:
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        for (owner, name), original in patched.items():
            setattr(owner, name, original)
    close(torch, prefill_out, expected[0], 1e-5, "prefill")
    close(torch, decode_out, expected[1], 1e-5, "decode")


def _check_cuda_graph_decode(torch):
    if DEVICE != "cuda":
        return SKIPPED + "CUDA graphs need the GPU (run with ASYNCENGINE_KERNEL_DEVICE=cuda)"
    from asyncengine.ops.triton_attention import paged_decode_attention

    batch = 4
    first, second = [5, 70, 0, 17], [33, 0, 71, 2]  # padding rows (0) in both
    case = make_case(torch, torch.bfloat16, [71, 33, 17, 5], num_blocks=24)
    _, key_cache, value_cache, block_tables, _ = case
    static_query = dev(torch.zeros(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16))
    static_lens = dev(torch.zeros(batch, dtype=torch.int32))
    static_tables = block_tables.clone()
    static_out = torch.full_like(static_query, float("nan"))
    gen = torch.Generator().manual_seed(5)

    def step():
        paged_decode_attention(static_query, key_cache, value_cache, static_tables, static_lens, HEAD_DIM**-0.5,
                               out=static_out)

    step()  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # Table rows hold contexts of 71, 33, 17 and 5 tokens; each replay permutes them under new lengths.
    for lens, order in ((first, [1, 0, 3, 2]), (second, [1, 2, 0, 3])):
        static_query.copy_(dev(torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)))
        static_lens.copy_(dev(torch.tensor(lens, dtype=torch.int32)))
        static_tables.copy_(block_tables[order])
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rows = [row for row, n in enumerate(lens) if n]
        want = reference(torch, static_query[rows], key_cache, value_cache, static_tables[rows], [1] * len(rows),
                          [lens[row] for row in rows])
        close(torch, static_out[rows], want, 1e-2, f"replay with seq_lens {lens}")
        if not bool((static_out[[r for r in range(batch) if not lens[r]]] == 0).all()):
            raise AssertionError(f"replay with seq_lens {lens}: padding rows are not zeros")
    return None



def _check_errors(torch):
    from asyncengine.ops.triton_attention import paged_decode_attention, paged_prefill_attention

    query, key_cache, value_cache, block_tables, _ = make_case(torch, torch.float32, SEQ_LENS)
    lens = dev(torch.tensor(SEQ_LENS, dtype=torch.int32))
    bad = [
        ((query[:, :3], key_cache, value_cache, block_tables, lens), {}, "not a multiple of 2 KV heads"),
        ((query, key_cache[:, :, :12], value_cache[:, :, :12], block_tables, lens), {}, "block size 12 is not a power"),
        ((query, key_cache, value_cache[..., :16], block_tables, lens), {}, "disagree"),
        ((query, key_cache, value_cache, block_tables, lens[:2]), {}, "3 queries, but seq_lens (2,)"),
        ((query, key_cache, value_cache, block_tables, lens.float()), {}, "seq_lens is torch.float32"),
        ((query, key_cache, value_cache, block_tables, lens), {"max_seq_len": 500}, "outside 0..96"),
        ((query, key_cache, value_cache, block_tables, lens), {"tile_tokens": 8}, "tile_tokens 8 must be a power"),
        ((query, key_cache, value_cache, block_tables, lens), {"tile_tokens": 48}, "at least the block size 16"),
    ]
    for args, options, message in bad:
        expect_error(lambda: paged_decode_attention(*args, 1.0, **options), message)
    query_start_loc, seq_lens = prefill_inputs(torch, [1, 1, 2], SEQ_LENS)
    four = torch.cat([query, query[:1]])
    prefill = lambda q=four, starts=query_start_loc, s=seq_lens, **kw: paged_prefill_attention(  # noqa: E731
        q, key_cache, value_cache, block_tables, starts, s, 1.0, **{"max_query_len": 2, **kw})
    expect_error(lambda: prefill(starts=query_start_loc[:3]), "query_start_loc (3,)")
    expect_error(lambda: prefill(s=seq_lens.float()), "seq_lens is torch.float32")
    expect_error(lambda: prefill(max_query_len=seq_lens.max()), "max_query_len must be a Python int")
    expect_error(lambda: prefill(block_m=24), "block_m 24 must be a power of two")
    expect_error(lambda: prefill(q=four.half()), "query torch.float16 and caches torch.float32 differ")


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
    caches = {name: (dev(k), dev(v)) for name, (k, v) in caches.items()}
    steps = [([1, 20], [40, 20]), ([1, 1], [41, 21])]
    backends = {"torch": TorchPagedBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5),
                "triton": TritonPagedBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)}
    for query_lens, seq_lens in steps:
        tokens = sum(query_lens)
        slots = []
        for row, (q, n) in enumerate(zip(query_lens, seq_lens)):
            slots += [int(block_tables[row, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n - q, n)]
        plan = plan_attention(query_lens, seq_lens, dev(block_tables), BLOCK_SIZE)
        metadata = AttentionMetadata(dev(torch.tensor(slots)), plan, query_lens, seq_lens, dev(block_tables))
        query = dev(torch.randn(tokens, HEADS, HEAD_DIM, generator=gen))
        key = dev(torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen))
        value = dev(torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen))
        outs = {name: backend.forward(query, key, value, caches[name], metadata) for name, backend in backends.items()}
        torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, s=query_lens: f"step with query_lens {s}: {m}")
        torch.testing.assert_close(caches["triton"][0], caches["torch"][0], rtol=0, atol=0)
        torch.testing.assert_close(caches["triton"][1], caches["torch"][1], rtol=0, atol=0)


def _child() -> None:
    import torch

    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on CPU, run by the tests with TRITON_INTERPRET=1 in the environment")
    if DEVICE == "cuda" and (os.environ.get("TRITON_INTERPRET", "0") != "0" or not torch.cuda.is_available()):
        raise SystemExit(f"{DEVICE_VARIABLE}=cuda needs a CUDA device and TRITON_INTERPRET unset")
    checks = {
        "fp32_splits": _check_fp32_splits,
        "split_sizes": _check_split_sizes,
        "padded_shapes": _check_padded_shapes,
        "decode_tiles": _check_decode_tiles,
        "decode_tile_choice": _check_decode_tile_choice,
        "no_stray_reads": _check_no_stray_reads,
        "fp16": lambda t: _check_half(t, t.float16),
        "bf16": lambda t: _check_half(t, t.bfloat16),
        "decode_padding_rows": _check_decode_padding_rows,
        "combine_all_empty": _check_combine_all_empty,
        "decode_grid_from_shapes": _check_decode_grid_from_shapes,
        "prefill_fp32": lambda t: _check_prefill(t, t.float32, 1e-5),
        "prefill_no_stray_reads": _check_prefill_no_stray_reads,
        "prefill_tiles": _check_prefill_tiles,
        "prefill_chunk_offsets": _check_prefill_chunk_offsets,
        "prefill_gqa": _check_prefill_gqa,
        "prefill_w1_fp32": lambda t: _check_prefill_w1(t, t.float32, 1e-5),
        "prefill_w1_bf16": lambda t: _check_prefill_w1(t, t.bfloat16, 1e-2),
        "prefill_fp16": lambda t: _check_prefill(t, t.float16, 1e-2),
        "prefill_bf16": lambda t: _check_prefill(t, t.bfloat16, 1e-2),
        "no_host_sync": _check_no_host_sync,
        "cuda_graph_decode": _check_cuda_graph_decode,
        "errors": _check_errors,
        "backend": _check_backend,
    }
    results: dict[str, str | None] = {}
    timings: dict[str, float] = {}
    for name, check in checks.items():
        began = time.perf_counter()
        try:
            results[name] = check(torch)
        except Exception:  # noqa: BLE001 - reported to the parent, whose test for this check fails with it
            results[name] = traceback.format_exc()
        timings[name] = round(time.perf_counter() - began, 2)
    print(json.dumps(timings), file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _child()
