"""Sliding-window attention and attention-logit soft-capping, in the torch reference (ops/paged_attention.py) and
in the CPU kernel (ops/cpu_attention.py), against a dense definition written here from transformers' eager
attention: scores `q.k * scale`, soft-capped as `tanh(s / cap) * cap`, key j visible to query i when
`j <= i` and `j > i - window`, a float32 softmax.

The blocks before a sequence's window are the ones a sliding layer's KV cache has freed: their table entries
may name any block. The kernel must never read them (here they name a block of NaNs, which any read would
spread); the torch reference's decode gathers whole tables and masks, so its freed entries name a zeroed
block (the null block, as the block manager leaves them).
"""

from __future__ import annotations

import random

import pytest
import torch

from asyncengine.attention.torch_paged import attend_in_place
from asyncengine.ops import cpu_attention
from asyncengine.ops.paged_attention import paged_attention, plan_attention

BLOCK_SIZE = 16


def make_windowed_batch(dtype, num_heads, num_kv_heads, head_dim, query_lens, seq_lens, window, *, poison: str,
                        seed: int = 0):
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 2
    freed = num_blocks - 1  # the block every freed table entry names
    order = list(range(num_blocks - 1))
    rng.shuffle(order)
    width = max(blocks_needed)
    tables, used = [], 0
    for count, query_len, seq_len in zip(blocks_needed, query_lens, seq_lens):
        row = order[used : used + count]
        used += count
        if window is not None:  # blocks wholly before the first query's window: freed
            first_needed = max(0, seq_len - query_len - window + 1) // BLOCK_SIZE
            row = [freed] * first_needed + row[first_needed:]
        tables.append(row + [0] * (width - count))
    cache_shape = (num_kv_heads, num_blocks, BLOCK_SIZE, head_dim)
    key_cache = torch.randn(cache_shape, generator=generator)
    value_cache = torch.randn(cache_shape, generator=generator)
    fill = float("nan") if poison == "nan" else 0.0
    key_cache[:, freed] = fill
    value_cache[:, freed] = fill
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    return query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), torch.tensor(tables, dtype=torch.int64)


def dense(query, key_cache, value_cache, tables, query_lens, seq_lens, scale, window, cap):
    """Row by row, over each sequence's gathered context."""
    out = torch.empty_like(query, dtype=torch.float32)
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[0]
    start = 0
    for row, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        blocks = tables[row, : -(-seq_len // BLOCK_SIZE)]
        keys = key_cache[:, blocks].reshape(num_kv_heads, -1, key_cache.shape[-1])[:, :seq_len].float()
        values = value_cache[:, blocks].reshape(num_kv_heads, -1, key_cache.shape[-1])[:, :seq_len].float()
        keys = keys.repeat_interleave(num_heads // num_kv_heads, 0)
        values = values.repeat_interleave(num_heads // num_kv_heads, 0)
        for i in range(query_len):
            position = seq_len - query_len + i
            scores = torch.einsum("hd,hkd->hk", query[start + i].float(), keys) * scale
            if cap is not None:
                scores = torch.tanh(scores / cap) * cap
            columns = torch.arange(seq_len)
            visible = columns <= position
            if window is not None:
                visible &= columns > position - window
            scores = scores.masked_fill(~visible, float("-inf"))
            out[start + i] = torch.einsum("hk,hkd->hd", torch.softmax(scores, -1), values)
        start += query_len
    return out


CASES = [
    # (heads, kv heads, head_dim, query_lens, seq_lens, window, soft cap)
    (8, 2, 64, [1, 1, 1, 1], [5, 40, 97, 300], 37, None),  # decodes: inside, at and far past the window
    (4, 4, 128, [1, 30, 1, 64], [16, 30, 129, 200], 32, None),  # a window of whole blocks, a chunk past it
    (6, 3, 40, [9, 1, 1], [9, 50, 18], 17, 50.0),  # both, a head size with no vector path
    (8, 2, 64, [1, 200, 12], [250, 200, 140], None, 30.0),  # soft cap alone, a whole prompt
    (8, 4, 128, [1, 1, 33], [700, 64, 100], 64, 20.0),  # Gemma 2's shape of things
    (4, 1, 256, [1, 1, 20], [300, 30, 100], 64, None),  # Gemma 3 270M's heads
]
IDS = ["decodes", "block-window", "window-and-cap-d40", "cap-only", "gemma2-like", "gemma3-d256"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torch_reference_is_the_definition(case):
    num_heads, num_kv_heads, head_dim, query_lens, seq_lens, window, cap = case
    query, key_cache, value_cache, tables = make_windowed_batch(torch.float32, num_heads, num_kv_heads, head_dim,
                                                                query_lens, seq_lens, window, poison="zeros")
    plan = plan_attention(query_lens, seq_lens, tables, BLOCK_SIZE)
    scale = head_dim**-0.5
    expected = dense(query, key_cache, value_cache, tables, query_lens, seq_lens, scale, window, cap)
    ours = paged_attention(query, key_cache, value_cache, plan, scale, sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_attention.available(torch.float32),
                    reason=f"CPU kernel not built: {cpu_attention.unavailable_reason()}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_kernel_is_the_definition_and_reads_nothing_before_the_window(dtype, case):
    num_heads, num_kv_heads, head_dim, query_lens, seq_lens, window, cap = case
    query, key_cache, value_cache, tables = make_windowed_batch(dtype, num_heads, num_kv_heads, head_dim,
                                                                query_lens, seq_lens, window, poison="nan")
    plan = plan_attention(query_lens, seq_lens, tables, BLOCK_SIZE)
    scale = head_dim**-0.5
    ours = paged_attention(query, key_cache, value_cache, plan, scale, in_place=attend_in_place,
                           sliding_window=window, logits_soft_cap=cap)
    assert ours.dtype == dtype and torch.isfinite(ours).all()  # no NaN block was read
    clean_key, clean_value = key_cache.float().nan_to_num(0.0), value_cache.float().nan_to_num(0.0)
    expected = dense(query, clean_key, clean_value, tables, query_lens, seq_lens, scale, window, cap)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), expected, atol=tolerance, rtol=tolerance)
