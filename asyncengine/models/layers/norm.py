"""RMSNorm, with the residual addition fused in (as the decoder layers use it).

A custom op (custom_op.py): a plugin may replace the class (`CustomOp.register_oot(name="RMSNorm")`)
or add a provider of op "rms_norm" (`register_op_impl`); `rms_norm_native` is the reference. On CPU, while
`native` is the provider that would run, the add and the norm run as one fused kernel (ops/cpu_fused.py).
"""

from __future__ import annotations

import torch
from torch import nn

from asyncengine.models.layers.custom_op import CustomOp
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
