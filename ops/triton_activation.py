"""SiLU-and-multiply as a Triton kernel, with the torch reference beside it.

`silu_and_mul_triton(x)` is the "triton" provider of op "silu_and_mul": `x` is `[..., 2 * d]`, gate
then up; the result `[..., d]` is `silu(gate) * up`, rounded where torch rounds (silu's result to
`x.dtype`, then the product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program; a row of d columns takes cdiv(d, BLOCK) programs


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_row_stride, out_row_stride, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_row_stride + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, out.to(gate.dtype), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dimension ({x.shape[-1]}) must be even (gate and up side by side)")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, BLOCK))](x2, out, x2.stride(0), out.stride(0), d,
                                                                    BLOCK=BLOCK)
    return out.view(*x.shape[:-1], d)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
