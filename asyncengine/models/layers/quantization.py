"""Quantization methods: `quantization="NAME"` picks the QuantizationConfig that builds the linear layers
(EXTENSION_POINTS.md, quantization methods). The interface (QuantizationConfig, LinearMethod) and the table are in the
floor, asyncengine.interfaces.quantization; here are the torch methods the linear layers run.

Embeddings, the lm_head and the norms are never quantized. The built-in "int8" (weight-only,
per-output-channel) is in the table by its path here, as a plugin may register one; a plugin uses
`@register_quantization_config("name")`. Registering imports nothing and resolves no platform.

This module does not import torch at import time (plugins_api imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# The interface and the table are in the floor (asyncengine.interfaces.quantization); imported here for
# the names code and plugins have used.
from asyncengine.interfaces.quantization import (
    LinearMethod,
    QuantizationConfig,
    QuantizationRegistry,
    _building_with,
    _QuantizationRegistry,
    building_with,
    process_weights_after_loading,
)

if TYPE_CHECKING:
    import torch
    from torch import nn


class UnquantizedLinearMethod(LinearMethod):
    """The plain float layer: `y = x W^T (+ b)`."""

    def create_weights(self, layer, input_size, output_size, params_dtype) -> None:
        import torch
        from torch import nn

        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False)

    def load_weight_rows(self, layer, row_offset, rows) -> None:
        layer.weight.data.narrow(0, row_offset, rows.shape[0]).copy_(rows)

    def process_weights_after_loading(self, layer) -> None:
        from asyncengine.models.layers import cpu_gemm

        # On CPU, the weight reordered once for oneDNN's matmul (cpu_gemm.py); None elsewhere.
        layer.cpu_packed_weight = cpu_gemm.pack(layer.weight)

    def apply(self, layer, x, bias=None):
        from asyncengine.models.layers import cpu_gemm

        return cpu_gemm.linear(x, layer.weight, getattr(layer, "cpu_packed_weight", None), bias)


# -- int8 weight-only (built in) -----------------------------------------------------------------------


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest, one float32 scale per output row: (int8 weight, scale)."""
    import torch

    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype)[:, None]


class Int8LinearMethod(LinearMethod):
    """`layer.weight` int8 (out, in) and `layer.weight_scale` float32 (out,), both Parameters without
    grad (so they count in parameter bytes). Quantized from the checkpoint's float rows as they load;
    forward dequantizes the weight to the activation dtype on each call (no int8 matmul on CPU)."""

    computed_parameters = ("weight_scale",)

    def create_weights(self, layer, input_size, output_size, params_dtype) -> None:
        import torch
        from torch import nn

        layer.weight = nn.Parameter(torch.zeros(output_size, input_size, dtype=torch.int8), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.zeros(output_size, dtype=torch.float32), requires_grad=False)

    def load_weight_rows(self, layer, row_offset, rows) -> None:
        q, scale = quantize_int8(rows)
        layer.weight.data.narrow(0, row_offset, rows.shape[0]).copy_(q)
        layer.weight_scale.data.narrow(0, row_offset, rows.shape[0]).copy_(scale)

    def apply(self, layer, x, bias=None):
        import torch.nn.functional as F

        return F.linear(x, dequantize_int8(layer.weight, layer.weight_scale, x.dtype), bias)


class Int8Config(QuantizationConfig):
    """Weight-only int8 for every ColumnParallelLinear / RowParallelLinear."""

    @classmethod
    def get_name(cls) -> str:
        return "int8"

    def get_quant_method(self, layer, prefix):
        return Int8LinearMethod()


# -- the registry --------------------------------------------------------------------------------------


def register_quantization_config(name: str, *, override: bool = False) -> Callable[[type], type]:
    """Class decorator: `@register_quantization_config("my_quant")` on a QuantizationConfig subclass."""

    def register(cls: type) -> type:
        QuantizationRegistry.register(name, cls, override=override)
        return cls

    return register


# -- the model being built -----------------------------------------------------------------------------


def linear_method_for(layer: Any, prefix: str = "") -> LinearMethod:
    config = _building_with.get()
    method = config.get_quant_method(layer, prefix) if config is not None else None
    return method if method is not None else UnquantizedLinearMethod()


__all__ = ["Int8Config", "Int8LinearMethod", "LinearMethod", "QuantizationConfig", "QuantizationRegistry",
           "UnquantizedLinearMethod", "building_with", "dequantize_int8", "linear_method_for",
           "process_weights_after_loading", "quantize_int8", "register_quantization_config"]
