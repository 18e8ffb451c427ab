"""The in-place CPU attention kernel (ops/cpu_attention.py) against the torch reference (ops/paged_attention.py).

The kernel attends every query row: decodes, and each row of a prefill as a causal query over its context
up to its own position (whole prompts and chunks after a cached prefix). Batches mix prefills and decodes
over shuffled cache blocks, with GQA groups of 1, 3 and 4 query heads per
KV head, head dims with a vector path (64, 128, 256) and without (40), contexts of one token, of whole blocks
and ragged; float32 must match the reference to rounding, bfloat16 to bfloat16's resolution.
"""

from __future__ import annotations

import random

import pytest
import torch

from asyncengine.attention.torch_paged import TorchPagedBackend, attend_in_place
from asyncengine.ops import cpu_attention
from asyncengine.ops.paged_attention import paged_attention, plan_attention, store_kv

pytestmark = pytest.mark.skipif(not cpu_attention.available(torch.float32),
                                reason=f"CPU kernel not built: {cpu_attention.unavailable_reason()}")

BLOCK_SIZE = 16


def make_batch(dtype, num_heads, num_kv_heads, head_dim, query_lens, seq_lens, seed=0, block_size=BLOCK_SIZE):
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 5
    order = list(range(num_blocks))
    rng.shuffle(order)
    width = max(blocks_needed)
    tables, used = [], 0
    for count in blocks_needed:
        row = order[used : used + count]
        used += count
        tables.append(row + [0] * (width - count))  # stale columns past the context: never read
    cache_shape = (num_kv_heads, num_blocks, block_size, head_dim)
    key_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    value_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(dtype)
    return query, key_cache, value_cache, torch.tensor(tables, dtype=torch.int64)


CASES = [
    # (heads, kv heads, head_dim, query_lens, seq_lens)
    (9, 3, 64, [1] * 12, [1, 15, 16, 17, 31, 32, 33, 100, 257, 300, 511, 640]),  # the default model's shape
    (8, 2, 128, [1, 5, 1, 1], [40, 20, 1, 129]),  # a prefill chunk among decodes
    (4, 4, 40, [1, 1, 7], [3, 64, 7]),  # no GQA, a head_dim with no vector path, a whole new prompt
    # W3's shape: a whole 200-token prompt, a 37-row chunk after 363 cached tokens, a one-block prompt
    (9, 3, 64, [1, 200, 37, 16, 1], [300, 200, 400, 16, 17]),
    (4, 1, 256, [1, 1, 20], [300, 17, 100]),  # Gemma 3 270M's heads: 4 query heads on one KV head of 256
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=["gqa3-d64", "gqa4-d128-mixed", "mha-d40", "gqa3-d64-prefills",
                                             "gqa4-d256"])
def test_kernel_matches_the_torch_reference(dtype, case):
    num_heads, num_kv_heads, head_dim, query_lens, seq_lens = case
    query, key_cache, value_cache, tables = make_batch(dtype, num_heads, num_kv_heads, head_dim, query_lens, seq_lens)
    plan = plan_attention(query_lens, seq_lens, tables, BLOCK_SIZE)
    scale = head_dim**-0.5
    reference = paged_attention(query.float(), key_cache.float(), value_cache.float(), plan, scale)
    ours = paged_attention(query, key_cache, value_cache, plan, scale, in_place=attend_in_place)
    assert ours.dtype == dtype and ours.shape == query.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16 keeps 8 bits of mantissa
    torch.testing.assert_close(ours.float(), reference, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaked_softmax_matches_the_reference(dtype):
    """Queries 40x larger: scores spread over hundreds, so most exponentials underflow to zero and a few
    dominate (the kernel's own vector exp, and its 16-key tree of sums, against torch's)."""
    query_lens, seq_lens = [1] * 5, [16, 48, 160, 333, 17]
    query, key_cache, value_cache, tables = make_batch(dtype, 9, 3, 64, query_lens, seq_lens, seed=3)
    query = (query.float() * 40).to(dtype)
    plan = plan_attention(query_lens, seq_lens, tables, BLOCK_SIZE)
    reference = paged_attention(query.float(), key_cache.float(), value_cache.float(), plan, 64**-0.5)
    ours = paged_attention(query, key_cache, value_cache, plan, 64**-0.5, in_place=attend_in_place)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), reference, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 32, 5])
def test_other_block_sizes_match_the_reference(block_size, dtype):
    """Blocks of 8 (shorter than the kernel's 16-key chunks), of 32 (two chunks per block) and of 5 (odd: the
    bfloat16 value products, two keys at a time, then take the widening path)."""
    query_lens, seq_lens = [1] * 4, [7, 40, 64, 97]
    query, key_cache, value_cache, tables = make_batch(dtype, 9, 3, 64, query_lens, seq_lens, seed=4,
                                                       block_size=block_size)
    plan = plan_attention(query_lens, seq_lens, tables, block_size)
    reference = paged_attention(query.float(), key_cache.float(), value_cache.float(), plan, 0.125)
    ours = paged_attention(query, key_cache, value_cache, plan, 0.125, in_place=attend_in_place)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), reference, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("sinks", [None, [0.5, 4.0, -1.0, 2.0, 0.0, 3.0]], ids=["plain", "sinks"])
def test_the_backend_uses_the_kernel_for_every_row_and_agrees_with_the_reference(monkeypatch, sinks):
    """Through TorchPagedBackend (store, then attend): the kernel runs, once per layer call for the
    decodes and the prefill alike, and the result equals the reference path's; a layer with sinks (GPT-OSS)
    too."""
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    query_lens, seq_lens = [1, 1, 9], [20, 48, 9]
    query, key_cache, value_cache, tables = make_batch(torch.float32, num_heads, num_kv_heads, head_dim,
                                                       query_lens, seq_lens, seed=1)
    new_key = torch.randn(sum(query_lens), num_kv_heads, head_dim)
    new_value = torch.randn(sum(query_lens), num_kv_heads, head_dim)
    slots = []
    for table, query_len, seq_len in zip(tables.tolist(), query_lens, seq_lens):
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len - query_len, seq_len)]
    metadata = type("Metadata", (), {})()
    metadata.slot_mapping = torch.tensor(slots)
    metadata.plan = plan_attention(query_lens, seq_lens, tables, BLOCK_SIZE)
    calls = []
    real = cpu_attention.paged_decode
    monkeypatch.setattr(cpu_attention, "paged_decode", lambda *a, **k: calls.append(k["sinks"]) or real(*a, **k))
    backend = TorchPagedBackend(num_heads, num_kv_heads, head_dim, head_dim**-0.5)
    backend.sinks = None if sinks is None else torch.tensor(sinks)
    caches = (key_cache.clone(), value_cache.clone())
    ours = backend.forward(query, new_key, new_value, caches, metadata)
    assert calls == [backend.sinks]
    store_kv(new_key, new_value, key_cache, value_cache, metadata.slot_mapping)
    reference = paged_attention(query, key_cache, value_cache, metadata.plan, head_dim**-0.5, sinks=backend.sinks)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_disabled_kernel_falls_back_to_the_reference_and_says_why(monkeypatch):
    monkeypatch.setattr(cpu_attention._kernels, "library", None)  # not loaded yet, as in a fresh process
    monkeypatch.setattr(cpu_attention._kernels, "reason", None)
    monkeypatch.setenv("ASYNCENGINE_CPU_KERNELS", "0")
    assert not cpu_attention.available(torch.float32)
    assert cpu_attention.unavailable_reason() == "ASYNCENGINE_CPU_KERNELS=0"
    with pytest.raises(RuntimeError, match="unavailable: ASYNCENGINE_CPU_KERNELS=0"):
        cpu_attention.paged_decode(*[torch.zeros(1)] * 7, 1.0, torch.zeros(1))


def test_float16_is_not_claimed():
    assert not cpu_attention.available(torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_the_reference_on_strided_views(dtype):
    """The C store against index_copy_ (paged_attention.store_kv): keys as a strided view of a fused QKV
    row, shuffled slots across blocks and KV heads; a slot outside the cache is refused, nothing written."""
    num_kv_heads, head_dim, num_blocks = 3, 64, 9
    generator = torch.Generator().manual_seed(7)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=generator)[:37]
    qkv = torch.randn(37, (9 + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
    key = qkv[:, 9 * head_dim : 12 * head_dim].view(37, num_kv_heads, head_dim)  # token stride 15 * head_dim
    value = qkv[:, 12 * head_dim :].reshape(37, num_kv_heads, head_dim)
    shape = (num_kv_heads, num_blocks, BLOCK_SIZE, head_dim)
    ours = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    reference = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    cpu_attention.store_kv(key, value, *ours, slots)
    store_kv(key, value, *reference, slots)
    assert torch.equal(ours[0], reference[0]) and torch.equal(ours[1], reference[1])
    outside = slots.clone()
    outside[5] = num_blocks * BLOCK_SIZE
    before = ours[0].clone()
    with pytest.raises(IndexError, match="outside the cache"):
        cpu_attention.store_kv(key + 1, value, *ours, outside)
    assert torch.equal(ours[0], before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[2]], ids=["gqa3-d64", "gqa3-d64-prefills", "mha-d40"])
@pytest.mark.parametrize("window", [None, 24])
def test_sinks_match_the_reference(dtype, case, window):
    """GPT-OSS's attention sinks: each query head's logit joins its softmax and attends to nothing. Sinks from
    -3 to 6 (some larger than every score, so they take most of the probability), with and without a sliding
    window; vector (d64) and generic (d40) paths."""
    num_heads, num_kv_heads, head_dim, query_lens, seq_lens = case
    query, key_cache, value_cache, tables = make_batch(dtype, num_heads, num_kv_heads, head_dim, query_lens, seq_lens,
                                                       seed=5)
    sinks = torch.linspace(-3.0, 6.0, num_heads)
    plan = plan_attention(query_lens, seq_lens, tables, BLOCK_SIZE)
    scale = head_dim**-0.5
    reference = paged_attention(query.float(), key_cache.float(), value_cache.float(), plan, scale,
                                sliding_window=window, sinks=sinks)
    without = paged_attention(query.float(), key_cache.float(), value_cache.float(), plan, scale,
                              sliding_window=window)
    assert (reference - without).abs().max() > 0.1  # the sinks change the result: the comparison below can fail
    ours = paged_attention(query, key_cache, value_cache, plan, scale, in_place=attend_in_place,
                           sliding_window=window, sinks=sinks)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), reference, atol=tolerance, rtol=tolerance)

