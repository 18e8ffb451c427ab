"""Storing a step's new keys and values into the paged KV cache, as a Triton kernel, with the torch
reference (`asyncengine.ops.paged_attention.store_kv`) beside it.

The cache layout is paged_attention.py's: per layer two tensors `[num_kv_heads, num_blocks,
block_size, head_dim]`, and token `t` goes to slot `slot_mapping[t] = block_id * block_size +
offset` (the model runner computes it from the request's block table). A negative slot means "do
not store" (a padding token), which the reference never receives; the kernel skips such tokens.

There is no op-provider slot for this (it is not a layer's op but a step of the attention backend):
`store_kv_triton` is a function with `store_kv`'s signature, for an attention backend to call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncengine.ops.paged_attention import store_kv as store_kv_reference

__all__ = ["store_kv_reference", "store_kv_triton"]


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, key_token_stride,
                     key_head_stride, value_token_stride, value_head_stride, cache_head_stride, cache_slot_stride,
                     head_dim, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        cols = tl.arange(0, BLOCK)
        mask = cols < head_dim
        k = tl.load(key_ptr + token * key_token_stride + head * key_head_stride + cols, mask=mask)
        v = tl.load(value_ptr + token * value_token_stride + head * value_head_stride + cols, mask=mask)
        # blocks of one head are contiguous: block * block_size + offset is one index over (blocks, offsets)
        dest = head * cache_head_stride + slot * cache_slot_stride + cols
        tl.store(key_cache_ptr + dest, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + dest, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Write each token's `[num_kv_heads, head_dim]` key and value to its slot, in place."""
    num_kv_heads, num_blocks, block_size, head_dim = key_cache.shape
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        raise ValueError(f"store_kv: key and value caches differ: {tuple(key_cache.shape)} {key_cache.stride()} "
                         f"vs {tuple(value_cache.shape)} {value_cache.stride()}")
    if not (key_cache.stride(3) == 1 and key_cache.stride(2) == head_dim and key_cache.stride(1) == block_size * head_dim):
        raise ValueError("store_kv: the cache must be contiguous within each head ([num_kv_heads, num_blocks, "
                         f"block_size, head_dim] with blocks packed), got strides {key_cache.stride()}")
    tokens = key.shape[0]
    if key.shape != (tokens, num_kv_heads, head_dim) or value.shape != key.shape or slot_mapping.shape != (tokens,):
        raise ValueError(f"store_kv: key {tuple(key.shape)}, value {tuple(value.shape)} must be [tokens, "
                         f"{num_kv_heads}, {head_dim}] and slot_mapping {tuple(slot_mapping.shape)} [tokens]")
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if tokens:
        _store_kv_kernel[(tokens, num_kv_heads)](
            key, value, key_cache, value_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0),
            value.stride(1), key_cache.stride(0), key_cache.stride(2), head_dim, BLOCK=triton.next_power_of_2(head_dim))
