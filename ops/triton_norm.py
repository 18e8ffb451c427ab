"""RMSNorm as Triton kernels, with the torch references beside them.

`rms_norm_triton(x, weight, eps)` is the "triton" provider of op "rms_norm" (same contract as
`asyncengine.models.layers.norm.rms_norm_native`, whose rounding it follows: statistics in float32,
the normalized row rounded to `x.dtype`, then scaled by `weight`). `fused_add_rms_norm_triton(x,
residual, weight, eps)` adds the residual in the same pass and returns `(norm(x + residual), x +
residual)`, the pair the RMSNorm layer returns with a residual; the op slot "rms_norm" has no
residual argument, so the layer cannot call it through a provider yet: it is here for a caller that can.

One program per row; the whole row is held in registers (`BLOCK` = the next power of two of the
hidden size), which suits the hidden sizes of the models served (up to some 16k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, x_row_stride, residual_row_stride,
                     out_row_stride, sum_row_stride, n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # The sum is rounded to the model dtype, as `x + residual` in torch is, before it is normalized.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * sum_row_stride + cols, x, mask=mask)
    h = x.to(tl.float32)
    mean_square = tl.sum(h * h, axis=0) / n_cols
    normalized = (h * (1.0 / tl.sqrt(mean_square + eps))).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normalized.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as a 2-D `[rows, hidden]` view whose rows are contiguous (a copy only when they are not)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({hidden},) for x of "
                         f"shape {tuple(x.shape)}")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)  # what `weight * h.to(x.dtype)` gives in torch
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    summed = torch.empty_like(x2) if residual is not None else out
    r2 = _rows(residual) if residual is not None else x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out, summed, x2.stride(0), r2.stride(0), out.stride(0), summed.stride(0),
            hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden))
    return out.view(x.shape), summed.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"fused_add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match "
                         f"x {tuple(x.shape)} {x.dtype}")
    return _launch(x, residual, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch reference (the same computation as the engine's `rms_norm_native`)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed
