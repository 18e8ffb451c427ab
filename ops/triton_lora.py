"""Batched LoRA as two Triton kernels (punica's shrink and expand), with the torch references beside them.

Every token carries the slot of its adapter (`token_slots[t]`, -1 for the base model), and the slot pools
are `a` `[slots, W, in]` and `b` `[slots, W, out]` (asyncengine/lora/layers.py: W is the fused projections'
padded rank, the scaling already in `b`).

- `lora_shrink(x, a, token_slots)`: `h[t] = a[slot_t] @ x[t]`, `[tokens, W]` in float32 (zeros for slot -1);
- `lora_expand(y, h, b, token_slots)`: `y[t] += h[t] @ b[slot_t]`, in place, rows of slot -1 untouched.

One program per (token, block of output columns): each reads only its own adapter's rows, so a batch of any
mix of adapters is one launch per kernel, never a pass per adapter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # output columns per program
BLOCK_K = 64  # reduction columns per loop iteration


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, in_features, width, x_stride, a_slot_stride, a_row_stride,
                   h_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < width
    slot = tl.load(slots_ptr + token).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if slot >= 0:
        for start in range(0, in_features, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            col_mask = cols < in_features
            x = tl.load(x_ptr + token * x_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * a_slot_stride + rows[:, None] * a_row_stride + cols[None, :],
                        mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + token * h_stride + rows, acc, mask=row_mask)


@triton.jit
def _expand_kernel(y_ptr, h_ptr, b_ptr, slots_ptr, width, out_features, y_stride, h_stride, b_slot_stride,
                   b_row_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, width, BLOCK_K):
            rows = start + tl.arange(0, BLOCK_K)
            row_mask = rows < width
            h = tl.load(h_ptr + token * h_stride + rows, mask=row_mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + slot * b_slot_stride + rows[:, None] * b_row_stride + cols[None, :],
                        mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(h[:, None] * b, axis=0)
        y = tl.load(y_ptr + token * y_stride + cols, mask=col_mask, other=0.0)
        tl.store(y_ptr + token * y_stride + cols, (y.to(tl.float32) + acc).to(y.dtype), mask=col_mask)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    a = a.contiguous()
    tokens, width = x.shape[0], a.shape[1]
    h = torch.empty((tokens, width), dtype=torch.float32, device=x.device)
    if tokens and width:
        grid = (tokens, triton.cdiv(width, BLOCK_N))
        _shrink_kernel[grid](x, a, token_slots, h, x.shape[1], width, x.stride(0), a.stride(0), a.stride(1),
                             h.stride(0), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    if y.stride(-1) != 1:
        raise ValueError("lora_expand adds into y in place: its rows must be contiguous")
    b = b.contiguous()
    tokens, out_features = y.shape
    if tokens and out_features:
        grid = (tokens, triton.cdiv(out_features, BLOCK_N))
        _expand_kernel[grid](y, h, b, token_slots, b.shape[1], out_features, y.stride(0), h.stride(0), b.stride(0),
                             b.stride(1), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y


def lora_shrink_reference(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    used = token_slots >= 0
    gathered = a[token_slots.clamp(min=0)].float()  # [tokens, W, in]
    h = torch.bmm(gathered, x.float().unsqueeze(-1)).squeeze(-1)
    return h * used.unsqueeze(-1)


def lora_expand_reference(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    used = token_slots >= 0
    gathered = b[token_slots.clamp(min=0)].float()  # [tokens, W, out]
    delta = torch.bmm(h.float().unsqueeze(1), gathered).squeeze(1)
    return torch.where(used.unsqueeze(-1), (y.float() + delta).to(y.dtype), y)
