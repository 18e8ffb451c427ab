"""SiLU-and-multiply: the gated activation of Llama-family MLPs.

A custom op (custom_op.py): replaceable by name ("SiluAndMul"), with providers of op "silu_and_mul";
`silu_and_mul_native` is the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncengine.models.layers.custom_op import CustomOp
from asyncengine.models.layers.op_registry import call_op


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@CustomOp.register("SiluAndMul")
class SiluAndMul(CustomOp):
    """Input `[..., 2 * d]` = gate and up projections side by side; output `silu(gate) * up`."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return call_op("silu_and_mul", x)
