"""Quantization methods, the interface: `quantization="NAME"` picks the QuantizationConfig that builds the
linear layers (EXTENSION_POINTS.md, quantization methods), and the table of methods.

A method is a `QuantizationConfig` subclass registered with `@register_quantization_config("name")`; its
`get_quant_method(layer, prefix)` returns the `LinearMethod` that creates, loads and applies the weights
of each ColumnParallelLinear / RowParallelLinear (None: leave that layer unquantized). Read in the
worker, which builds the model; the frontend checks the name before anything starts. The built-in
"int8" and the plain float method are in asyncengine/models/layers/quantization.py (torch code).

No torch import here (annotations only).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from asyncengine.errors import ConfigError, ModelLoadError
from asyncengine.interfaces.imports import import_by_path
from asyncengine.interfaces.registry import BUILT_IN, Registry

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


# -- the table of methods -------------------------------------------------------------------------------


class _QuantizationRegistry(Registry):
    def __init__(self) -> None:
        super().__init__("quantization", "quantization method")

    def config_class(self, name: str) -> type[QuantizationConfig]:
        """The QuantizationConfig registered as `name`; unknown names list the known ones."""
        entry = self.get(name)
        if entry is None:
            raise ConfigError(f"quantization {name!r} names no quantization method; known: {', '.join(self.keys())} "
                              "(a plugin adds one with register_quantization_config)", field="quantization")
        cls = entry.implementation
        if isinstance(cls, str):
            cls = import_by_path(cls, what=f"quantization method {name!r}", error=ModelLoadError)
        if not (isinstance(cls, type) and issubclass(cls, QuantizationConfig)):
            raise ConfigError(f"quantization method {name!r} is {cls!r} (registered by {entry.owner}), not a "
                              "QuantizationConfig subclass", field="quantization")
        return cls


QuantizationRegistry = _QuantizationRegistry()
# By path, so that the table imports no torch; the same class the worker builds.
QuantizationRegistry.register("int8", "asyncengine.models.layers.quantization:Int8Config", owner=BUILT_IN)
QuantizationRegistry.register("int8_dynamic", "asyncengine.models.layers.quantization:Int8DynamicConfig",
                              owner=BUILT_IN)
QuantizationRegistry.register("gguf", "asyncengine.models.layers.gguf_linear:GgufConfig", owner=BUILT_IN)


# -- the model being built: linear layers built inside `building_with(config)` take their method from it --

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


def process_weights_after_loading(model: Any) -> None:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, LinearMethod):
            method.process_weights_after_loading(module)


__all__ = ["LinearMethod", "QuantizationConfig", "QuantizationRegistry", "building_with",
           "process_weights_after_loading"]
