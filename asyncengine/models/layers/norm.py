"""RMSNorm, with the residual addition fused in (as the decoder layers use it), and GemmaRMSNorm (its weight
applied in float32, before the rounding: Gemma's `1 + w`, OLMo 2).

A custom op (interfaces/torch_bases.py): a plugin may replace the class (`CustomOp.register_oot(name="RMSNorm")`)
or add a provider of op "rms_norm" (`register_op_impl`); `rms_norm_native` is the reference. On CPU, while
`native` is the provider that would run, the add and the norm run as one fused kernel (ops/cpu_fused.py).
"""

from __future__ import annotations

import torch
from torch import nn

from asyncengine.interfaces.torch_bases import CustomOp
from asyncengine.models.layers.op_registry import call_op, native_first
from asyncengine.ops import cpu_fused


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in float32 whatever the model dtype, then scale in the model dtype, as
    # transformers does: parity depends on rounding at the same places.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@CustomOp.register("RMSNorm")
class RMSNorm(CustomOp):
    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`; or, given the running residual, `(norm(x + residual), x + residual)`."""
        if residual is None:
            return call_op("rms_norm", x, self.weight, self.eps)
        x = x + residual
        return call_op("rms_norm", x, self.weight, self.eps), x

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`forward_native` in one fused pass (ops/cpu_fused.py) where nothing else was chosen: not in a
        subclass that overrides `forward_native` (a replacement's own code runs), not when a provider other
        than `native` comes first, not for a layout or dtype the kernel lacks."""
        if (type(self).forward_native is RMSNorm.forward_native and native_first("rms_norm")
                and cpu_fused.rms_norm_supported(x, self.weight, residual)):
            return cpu_fused.rms_norm(x, self.weight, self.eps, residual)
        return self.forward_native(x, residual)


def rms_norm_float32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`(norm(x) * weight).to(x.dtype)` with everything in float32 until the one rounding: Gemma's
    `(1 + w)` form and OLMo 2's norm round after the weight, where Llama's rounds the norm first."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float()).to(x.dtype)


@CustomOp.register("GemmaRMSNorm")
class GemmaRMSNorm(CustomOp):
    """RMSNorm whose weight multiplies in float32 before the rounding to the model's dtype, the weight being
    `weight_offset + w`: Gemma's `(1 + w)` (weight_offset 1, the checkpoint's zero-centred weights) and
    OLMo 2's plain `w` (weight_offset 0). Same calls as RMSNorm: `norm(x)`, or with the running residual
    `(norm(x + residual), x + residual)` (the sum in the model's dtype, as transformers adds)."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, weight_offset: float = 1.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - weight_offset, dtype=dtype), requires_grad=False)
        self._effective: torch.Tensor | None = None  # float32 offset + weight, rebuilt when the weight changes
        self._effective_version = -1

    def effective_weight(self) -> torch.Tensor:
        version = self.weight._version
        if self._effective is None or self._effective_version != version or self._effective.device != self.weight.device:
            self._effective = (self.weight.float() + self.weight_offset).contiguous()
            self._effective_version = version
        return self._effective

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm_float32_weight(x, self.effective_weight(), self.eps)
        x = x + residual
        return rms_norm_float32_weight(x, self.effective_weight(), self.eps), x

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`forward_native` as one fused pass (ops/cpu_fused.py, its float32-weight mode), unless a subclass
        replaced `forward_native` or the layout or dtype is one the kernel lacks."""
        weight = self.effective_weight()
        if (type(self).forward_native is GemmaRMSNorm.forward_native
                and cpu_fused.rms_norm_supported(x, weight, residual, weight_f32=True)):
            return cpu_fused.rms_norm(x, weight, self.eps, residual, weight_f32=True)
        return self.forward_native(x, residual)
