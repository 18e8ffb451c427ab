"""SiLU-and-multiply: the gated activation of Llama-family MLPs.

A custom op (custom_op.py): replaceable by name ("SiluAndMul"), with providers of op "silu_and_mul";
`silu_and_mul_native` is the reference. On CPU, while `native` is the provider that would run, one fused
kernel (ops/cpu_fused.py) computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncengine.models.layers.custom_op import CustomOp
from asyncengine.models.layers.op_registry import call_op, native_first
from asyncengine.ops import cpu_fused


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@CustomOp.register("SiluAndMul")
class SiluAndMul(CustomOp):
    """Input `[..., 2 * d]` = gate and up projections side by side; output `silu(gate) * up`."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return call_op("silu_and_mul", x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """`forward_native` as one fused kernel, under the conditions of RMSNorm.forward_cpu (norm.py)."""
        if (type(self).forward_native is SiluAndMul.forward_native and native_first("silu_and_mul")
                and cpu_fused.silu_and_mul_supported(x)):
            return cpu_fused.silu_and_mul(x)
        return self.forward_native(x)
