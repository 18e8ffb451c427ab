"""Cases and references shared by the attention kernels' checks (test_triton_attention.py's child,
which runs on CPU under the Triton interpreter or compiled on CUDA): random paged caches with scattered
block tables, the torch reference on CPU in fp32, and the kernel calls with NaN-poisoned outputs.
Functions take the `torch` module as an argument: the pytest process imports this module without torch.
"""

from __future__ import annotations

import os

KV_HEADS, HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 4, 32, 16, 24
SEQ_LENS = [5, 16, 70]  # part of a block, exactly one block, five blocks (three splits of two)
DEVICE_VARIABLE = "ASYNCENGINE_KERNEL_DEVICE"
DEVICE = os.environ.get(DEVICE_VARIABLE, "cpu")
PREFILL_QUERY_LENS, PREFILL_SEQ_LENS = [20, 9, 1, 40], [20, 37, 50, 40]


def dev(tensor):
    """Every tensor the kernels see goes through here: made on CPU, moved to the device under test."""
    return tensor.to(DEVICE)


def layout(torch, seq_lens, block_size, num_blocks, gen):
    """Block tables with each sequence's blocks scattered over the pool (a spare column: tables are padded)."""
    pool = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for row, n in enumerate(seq_lens):
        blocks = -(-n // block_size)
        block_tables[row, :blocks] = pool[used : used + blocks]
        used += blocks
    if used > num_blocks:
        raise ValueError(f"the case needs {used} blocks, the pool has {num_blocks}")
    return block_tables


def make_case(torch, dtype, seq_lens, *, kv_heads=KV_HEADS, heads=HEADS, head_dim=HEAD_DIM, nan_cache=False,
          block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, query_rows=None):
    """Random caches and `query_rows` (default: one per sequence) query rows, on the device; with
    `nan_cache`, NaN everywhere but the contexts' slots, and the clean caches (CPU, fp32) returned too."""
    gen = torch.Generator().manual_seed(len(seq_lens) * 1000 + sum(seq_lens) + head_dim + heads)
    key_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    value_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    query = torch.randn(len(seq_lens) if query_rows is None else query_rows, heads, head_dim, generator=gen)
    block_tables = layout(torch, seq_lens, block_size, num_blocks, gen)
    clean = None
    if nan_cache:
        valid = torch.zeros(kv_heads, num_blocks, block_size, dtype=torch.bool)
        for row, n in enumerate(seq_lens):
            for position in range(n):
                valid[:, block_tables[row, position // block_size], position % block_size] = True
        clean = (key_cache.clone(), value_cache.clone())
        key_cache[~valid] = float("nan")
        value_cache[~valid] = float("nan")
    return (dev(query.to(dtype)), dev(key_cache.to(dtype)), dev(value_cache.to(dtype)), dev(block_tables),
            clean)


def reference(torch, query, key_cache, value_cache, block_tables, query_lens, seq_lens):
    """The torch reference, on CPU in fp32."""
    from asyncengine.ops.paged_attention import paged_attention, plan_attention

    plan = plan_attention(query_lens, seq_lens, block_tables.cpu().long(), key_cache.shape[2])
    return paged_attention(query.cpu().float(), key_cache.cpu().float(), value_cache.cpu().float(), plan,
                           query.shape[-1] ** -0.5)


def close(torch, got, want, tolerance, what=""):
    torch.testing.assert_close(got.cpu().float(), want, rtol=tolerance, atol=tolerance,
                               msg=lambda m: f"{what}: {m}" if what else m)


def run_decode(torch, query, key_cache, value_cache, block_tables, seq_lens, **options):
    from asyncengine.ops.triton_attention import paged_decode_attention

    out = torch.full_like(query, float("nan"))  # poisoned: a row the kernel skips stays NaN
    returned = paged_decode_attention(query, key_cache, value_cache, block_tables,
                                      dev(torch.tensor(seq_lens, dtype=torch.int32)), query.shape[-1] ** -0.5,
                                      out=out, **options)
    if returned is not out:
        raise AssertionError("paged_decode_attention did not return the `out` it filled")
    return out


def decode_reference(torch, case, seq_lens):
    return reference(torch, *case[:4], [1] * len(seq_lens), seq_lens)


def prefill_inputs(torch, query_lens, seq_lens):
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return dev(torch.tensor(starts, dtype=torch.int32)), dev(torch.tensor(seq_lens, dtype=torch.int32))


def run_prefill(torch, query, key_cache, value_cache, block_tables, query_lens=PREFILL_QUERY_LENS,
                 seq_lens=PREFILL_SEQ_LENS, max_query_len=None, **options):
    from asyncengine.ops.triton_attention import paged_prefill_attention

    query_start_loc, lens = prefill_inputs(torch, query_lens, seq_lens)
    out = torch.full_like(query, float("nan"))
    returned = paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, lens,
                                       query.shape[-1] ** -0.5, out=out,
                                       max_query_len=max(query_lens) if max_query_len is None else max_query_len,
                                       **options)
    if returned is not out:
        raise AssertionError("paged_prefill_attention did not return the `out` it filled")
    return out


def prefill_case(torch, dtype, query_lens=PREFILL_QUERY_LENS, seq_lens=PREFILL_SEQ_LENS, **shape):
    return make_case(torch, dtype, seq_lens, query_rows=sum(query_lens), **shape)



def expect_error(call, message):
    try:
        call()
    except ValueError as error:
        if message not in str(error):
            raise AssertionError(f"expected {message!r} in the error, got: {error}") from error
    else:
        raise AssertionError(f"no error for a call that should say {message!r}")

