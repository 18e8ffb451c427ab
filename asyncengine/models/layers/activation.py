"""SiLU-and-multiply, the gated activation of Llama-family MLPs, and GELU-and-multiply (GeGLU, Gemma's).

A custom op (interfaces/torch_bases.py): replaceable by name ("SiluAndMul"), with providers of op "silu_and_mul";
`silu_and_mul_native` is the reference. On CPU, while `native` is the provider that would run, one fused
kernel (ops/cpu_fused.py) computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncengine.errors import ModelLoadError
from asyncengine.interfaces.torch_bases import CustomOp
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


@CustomOp.register("GeluAndMul")
class GeluAndMul(CustomOp):
    """GeGLU: input `[..., 2 * d]` = gate and up projections side by side; output `gelu(gate) * up`, GELU's tanh
    approximation (transformers' `gelu_pytorch_tanh`, Gemma's activation) or the exact erf form (`gelu`).
    vLLM's name and constructor argument. Runs in torch on every device (no fused kernel yet)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GeluAndMul(approximate={approximate!r}): 'none' or 'tanh'")
        self.approximate = approximate

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


def gated_activation(hidden_act: str) -> CustomOp:
    """The `act(gate) * up` op of a config's `hidden_act` / `hidden_activation`: SiLU (Llama, Qwen, Mistral,
    Phi-3, OLMo 2, Granite, GLM-4) or GELU (Gemma: `gelu_pytorch_tanh`)."""
    if hidden_act in ("silu", "swish"):
        return SiluAndMul()
    if hidden_act == "gelu_pytorch_tanh":
        return GeluAndMul(approximate="tanh")
    if hidden_act == "gelu":
        return GeluAndMul()
    raise ModelLoadError(f"hidden activation {hidden_act!r} is not supported in a gated MLP (supported: silu, gelu, "
                     "gelu_pytorch_tanh)")
