"""Quantization methods: `quantization="NAME"` picks the QuantizationConfig that builds the linear layers
(docs/reference.md, quantization methods). The interface (QuantizationConfig, LinearMethod) and the table are in the
floor, asyncengine.interfaces.quantization; here are the torch methods the linear layers run.

Embeddings, the lm_head and the norms are never quantized. The built-in "int8" (weight-only,
per-output-channel) and "int8_dynamic" (the same weights, activations quantized per row at each call, an
int8 matmul) are in the table by their paths here, as a plugin may register one; a plugin uses
`@register_quantization_config("name")`. Registering imports nothing and resolves no platform.

This module does not import torch at import time (plugins_api imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from asyncengine.interfaces.quantization import (
    LinearMethod,
    QuantizationConfig,
    QuantizationRegistry,
    _building_with,
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
    forward dequantizes the weight to the activation dtype on each call, except for a few bfloat16 rows on
    CPU, which torch's packed int8 kernel multiplies directly (`INT8PACK_MAX_ROWS`). It saves memory, not
    time: `int8_dynamic` is the faster one."""

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

        if _int8pack_pays(x, layer.weight):
            import torch

            y = torch._weight_int8pack_mm(x, layer.weight, layer.weight_scale.to(x.dtype))
            return y if bias is None else y + bias
        return F.linear(x, dequantize_int8(layer.weight, layer.weight_scale, x.dtype), bias)


# Rows up to which torch's packed int8 CPU kernel beats dequantizing the weight (bfloat16 activations):
# measured on the 2-core machine (one thread, the default model's four layer shapes, bench/RESULTS.md):
# 1 row 0.41 against 3.8 ms, 8 rows 1.3 against 4.1 ms; equal at 32. In float32 torch's kernel is a slow
# reference loop (8 rows: 38 ms), so float32 keeps the dequantizing path.
INT8PACK_MAX_ROWS = 16


def _int8pack_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    import torch

    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= INT8PACK_MAX_ROWS
            and weight.dtype == torch.int8 and weight.is_contiguous())


class Int8Config(QuantizationConfig):
    """Weight-only int8 for every ColumnParallelLinear / RowParallelLinear."""

    @classmethod
    def get_name(cls) -> str:
        return "int8"

    def get_quant_method(self, layer, prefix):
        return Int8LinearMethod()


# -- int8 weights and activations (built in) ------------------------------------------------------------


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x` symmetric to int8 (its own float32 scale, so a row's result does not depend on the
    other rows of the batch): (int8 rows, scale `[rows, 1]`)."""
    import torch

    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale


def int8_dynamic_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What `Int8DynamicLinearMethod` computes, in float64 (exact: the int8 products and their sums fit a
    float64's 53 bits): `x` quantized per row, times the int8 weight, scaled back."""
    import torch

    xq, x_scale = quantize_rows_int8(x)
    accumulated = xq.to(torch.float64) @ q.to(torch.float64).t()
    return (accumulated * (x_scale.to(torch.float64) * scale.to(torch.float64))).to(x.dtype)


class Int8DynamicLinearMethod(Int8LinearMethod):
    """int8 weights as `Int8LinearMethod` holds them (one scale per output row), and activations quantized
    to int8 per row at each call: the matmul runs on int8 with int32 sums (`torch._int_mm`, oneDNN's
    VNNI/AMX-int8 kernels on a CPU that has them), then one multiply by both scales. Faster than float32
    (the linear layers at 1-32 rows: 1.6-2.2x on the 2-core machine, bench/RESULTS.md), at the accuracy
    bench/RESULTS.md states (activations lose more than the weights do: about 7 bits per row)."""

    def apply(self, layer, x, bias=None):
        import torch

        from asyncengine.ops import cpu_int8

        rows = x.reshape(-1, x.shape[-1])
        # On CPU the quantization and the scaling back are one C pass each (ops/cpu_int8.py, bit-equal to
        # the torch ops below, which were as costly as the int8 matmul itself at a decode step's rows).
        in_c = rows.device.type == "cpu" and rows.stride(-1) == 1 and cpu_int8.available(x.dtype)
        xq, x_scale = cpu_int8.quantize_rows(rows) if in_c else quantize_rows_int8(rows)
        # torch._int_mm: int8 [m, k] @ int8 [k, n] -> int32; the weight's transpose is a view.
        acc = torch._int_mm(xq, layer.weight.t())
        if in_c:
            y = cpu_int8.scale_rows(acc, x_scale, layer.weight_scale, x.dtype)
        else:
            y = (acc * (x_scale * layer.weight_scale)).to(x.dtype)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias


class Int8DynamicConfig(QuantizationConfig):
    """int8 weights and per-row int8 activations for every ColumnParallelLinear / RowParallelLinear."""

    @classmethod
    def get_name(cls) -> str:
        return "int8_dynamic"

    def get_quant_method(self, layer, prefix):
        return Int8DynamicLinearMethod()


# -- the registry --------------------------------------------------------------------------------------


def register_quantization_config(name: str, *, override: bool = False) -> Callable[[type], type]:
    """Class decorator: `@register_quantization_config("my_quant")` on a QuantizationConfig subclass."""

    def register(cls: type) -> type:
        QuantizationRegistry.register(name, cls, override=override)
        return cls

    return register


# -- the model being built -----------------------------------------------------------------------------


def linear_method_for(layer: Any, prefix: str = "") -> LinearMethod:
    """The method of a linear layer being built: the quantization config's (ours, or vLLM's LinearMethodBase
    through models/layers/vllm_linear.py), else the plain float one."""
    from asyncengine.interfaces.plugin_code import plugin_hook
    from asyncengine.models.layers.vllm_linear import as_linear_method

    config = _building_with.get()
    if config is None:
        return UnquantizedLinearMethod()
    with plugin_hook(config, "get_quant_method"):
        method = config.get_quant_method(layer, prefix)
    chosen = as_linear_method(method)
    return chosen if chosen is not None else UnquantizedLinearMethod()


__all__ = ["Int8Config", "Int8DynamicConfig", "Int8DynamicLinearMethod", "Int8LinearMethod",
           "UnquantizedLinearMethod", "dequantize_int8", "linear_method_for", "int8_dynamic_reference",
           "quantize_int8", "quantize_rows_int8", "register_quantization_config"]
