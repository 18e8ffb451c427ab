"""Rotary position embedding as a Triton kernel, with the torch reference beside it.

The layout is the engine's (asyncengine/models/layers/rotary.py): the "neox" halves, not interleaved
pairs. Dimension `i < d/2` pairs with `i + d/2`; cos/sin `[tokens, 1, head_dim]` hold each angle
twice (`cat((angles, angles))`), and the rotation is `x * cos + rotate_half(x) * sin` with
`rotate_half(x) = cat((-second_half, first_half))`. The kernel reads cos/sin across the whole head
dimension (not half of it), so it equals that formula for any cos/sin given, and rounds where torch
does (each product to the tensor dtype, then the sum).

`rotary_triton(query, key, cos, sin)` is the "triton" provider of op "rotary": `query` `[tokens,
heads, head_dim]`, `key` `[tokens, kv_heads, head_dim]`; it returns new rotated tensors, as the
reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, x_token_stride, x_head_stride, cos_token_stride,
                   sin_token_stride, out_token_stride, out_head_stride, half, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < half
    x_row = x_ptr + token * x_token_stride + head * x_head_stride
    first = tl.load(x_row + cols, mask=mask, other=0.0)
    second = tl.load(x_row + half + cols, mask=mask, other=0.0)
    cos1 = tl.load(cos_ptr + token * cos_token_stride + cols, mask=mask, other=0.0)
    cos2 = tl.load(cos_ptr + token * cos_token_stride + half + cols, mask=mask, other=0.0)
    sin1 = tl.load(sin_ptr + token * sin_token_stride + cols, mask=mask, other=0.0)
    sin2 = tl.load(sin_ptr + token * sin_token_stride + half + cols, mask=mask, other=0.0)
    dtype = first.dtype
    f, s = first.to(tl.float32), second.to(tl.float32)
    # out[:half] = first * cos1 + (-second) * sin1; out[half:] = second * cos2 + first * sin2
    out1 = (f * cos1.to(tl.float32)).to(dtype).to(tl.float32) + (-s * sin1.to(tl.float32)).to(dtype).to(tl.float32)
    out2 = (s * cos2.to(tl.float32)).to(dtype).to(tl.float32) + (f * sin2.to(tl.float32)).to(dtype).to(tl.float32)
    out_row = out_ptr + token * out_token_stride + head * out_head_stride
    tl.store(out_row + cols, out1.to(dtype), mask=mask)
    tl.store(out_row + half + cols, out2.to(dtype), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    tokens, heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if tokens and heads:
        half = head_dim // 2
        _rotary_kernel[(tokens, heads)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                                        out.stride(0), out.stride(1), half, BLOCK=triton.next_power_of_2(half))
    return out


def _table(t: torch.Tensor, tokens: int, head_dim: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    if t.shape[-1] != head_dim or t.numel() != tokens * head_dim:
        raise ValueError(f"rotary: {name} has shape {tuple(t.shape)}, expected [{tokens}, 1, {head_dim}] "
                         "(one row per token, as RotaryEmbedding.lookup returns)")
    return t.reshape(tokens, head_dim).to(dtype).contiguous()


def rotary_triton(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, _, head_dim = query.shape
    if head_dim % 2 or key.shape[0] != tokens or key.shape[-1] != head_dim:
        raise ValueError(f"rotary: query {tuple(query.shape)} and key {tuple(key.shape)} must be [tokens, heads, "
                         "head_dim] with the same tokens and an even head_dim")
    cos = _table(cos, tokens, head_dim, query.dtype, "cos")
    sin = _table(sin, tokens, head_dim, query.dtype, "sin")
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary_reference(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin
