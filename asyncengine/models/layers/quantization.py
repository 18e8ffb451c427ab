"""Quantization methods: `quantization="NAME"` picks the QuantizationConfig that builds the linear layers
(EXTENSION_POINTS.md, R4).

A method is a `QuantizationConfig` subclass registered with `@register_quantization_config("name")`; its
`get_quant_method(layer, prefix)` returns the `LinearMethod` that creates, loads and applies the weights
of each ColumnParallelLinear / RowParallelLinear (None: leave that layer unquantized). Embeddings, the
lm_head and the norms are never quantized. The built-in "int8" (weight-only, per-output-channel) registers
here in code, through the same door a plugin uses. Read in the worker, which builds the model; the
frontend checks the name before anything starts. Registering imports nothing and resolves no platform.

This module does not import torch at import time (plugins_api imports it).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from asyncengine.errors import ConfigError
from asyncengine.registries.base import BUILT_IN, Registry

if TYPE_CHECKING:
    import torch
    from torch import nn


class LinearMethod:
    """How one linear layer holds and applies its weight. The layer keeps its bias (unquantized) and
    adds it through `apply`; a RowParallelLinear passes `bias=None` and adds it after the all-reduce."""

    # Parameters this method computes while loading (a scale), which the checkpoint does not provide.
    computed_parameters: tuple[str, ...] = ()

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        """Register the layer's weight tensors (`layer.weight`, which the checkpoint's `...weight` fills)."""
        raise NotImplementedError

    def load_weight_rows(self, layer: nn.Module, row_offset: int, rows: torch.Tensor) -> None:
        """Fill output rows [row_offset, row_offset + len(rows)) of the weight from the checkpoint's float
        rows (already this rank's part: its output rows, its input columns)."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once every weight is loaded (repack, transpose, ...); nothing by default."""


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


class QuantizationConfig:
    """A quantization method, as `quantization=NAME` names it. Built once per model (`cls()`, or
    `from_model_config` if it needs the model's config); the worker asks it for each linear layer's method."""

    @classmethod
    def get_name(cls) -> str:
        raise NotImplementedError(f"{cls.__qualname__} must implement get_name()")

    @classmethod
    def from_model_config(cls, hf_config: Any) -> QuantizationConfig:
        return cls()

    @classmethod
    def verify_config(cls, engine_config: Any, hf_config: Any) -> None:
        """Called in the frontend, once the model's config is known and before anything is spawned, with
        the engine options and the model's config as attributes (what `from_model_config` gets): raise
        ConfigError to refuse what the method cannot hold (a dtype, a layer width, a tensor-parallel
        size). Accepts everything by default."""

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The method for `layer` (a ColumnParallelLinear or RowParallelLinear); None: unquantized.
        `prefix` is the layer's name in the model where the model passes it ("" in the built-in models)."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement get_quant_method(layer, prefix)")


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


class _QuantizationRegistry(Registry):
    def __init__(self) -> None:
        super().__init__("quantization", "quantization method")

    def config_class(self, name: str) -> type[QuantizationConfig]:
        """The QuantizationConfig registered as `name`; unknown names list the known ones."""
        from asyncengine.models.registry import import_by_path

        entry = self.get(name)
        if entry is None:
            raise ConfigError(f"quantization {name!r} names no quantization method; known: {', '.join(self.keys())} "
                              "(a plugin adds one with register_quantization_config)", field="quantization")
        cls = entry.implementation
        if isinstance(cls, str):
            cls = import_by_path(cls, what=f"quantization method {name!r}")
        if not (isinstance(cls, type) and issubclass(cls, QuantizationConfig)):
            raise ConfigError(f"quantization method {name!r} is {cls!r} (registered by {entry.owner}), not a "
                              "QuantizationConfig subclass", field="quantization")
        return cls


QuantizationRegistry = _QuantizationRegistry()


def register_quantization_config(name: str, *, override: bool = False) -> Callable[[type], type]:
    """Class decorator: `@register_quantization_config("my_quant")` on a QuantizationConfig subclass."""

    def register(cls: type) -> type:
        QuantizationRegistry.register(name, cls, override=override)
        return cls

    return register


QuantizationRegistry.register("int8", Int8Config, owner=BUILT_IN)


# -- the model being built -----------------------------------------------------------------------------

_building_with: contextvars.ContextVar[QuantizationConfig | None] = contextvars.ContextVar(
    "quantization_config", default=None)


@contextlib.contextmanager
def building_with(config: QuantizationConfig | None) -> Iterator[None]:
    """Linear layers constructed inside take their method from `config` (the loader sets it)."""
    token = _building_with.set(config)
    try:
        yield
    finally:
        _building_with.reset(token)


def linear_method_for(layer: Any, prefix: str = "") -> LinearMethod:
    config = _building_with.get()
    method = config.get_quant_method(layer, prefix) if config is not None else None
    return method if method is not None else UnquantizedLinearMethod()


def process_weights_after_loading(model: Any) -> None:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, LinearMethod):
            method.process_weights_after_loading(module)
