"""Quantization methods, the interface: `quantization="NAME"` picks the QuantizationConfig that builds the
linear layers (docs/reference.md, quantization methods), and the table of methods.

A method is a `QuantizationConfig` subclass registered with `@register_quantization_config("name")`; its
`get_quant_method(layer, prefix)` returns the `LinearMethod` that creates, loads and applies the weights
of each ColumnParallelLinear / RowParallelLinear (None: leave that layer unquantized). Read in the
worker, which builds the model; the frontend checks the name before anything starts. The built-in
"int8" and the plain float method are in asyncengine/models/layers/quantization.py (torch code).

No torch import here (annotations only).
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncengine.errors import ModelLoadError
from asyncengine.interfaces.plugin_code import plugin_hook
from asyncengine.interfaces.registry import BUILT_IN, Registry, reads

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
    """A quantization method, as `quantization=NAME` names it, in vLLM's shape (vLLM's QuantizationConfig's
    attributes and methods; docs/porting.md, quantization). Built once per model in the worker by
    `quantization_config_for`: `from_config(checkpoint's quantization config)` (vLLM's way), or
    `from_model_config(hf_config)` where a class overrides that (ours, given the whole model config); the
    worker asks it for each linear layer's method."""

    # vLLM's: fused checkpoint modules -> the modules they hold ({"qkv_proj": ["q_proj", "k_proj", "v_proj"]}),
    # which a method reads to treat a fused layer as its parts. Set by the model; informational here.
    packed_modules_mapping: dict[str, list[str]] = {}

    def __init__(self) -> None:
        self.packed_modules_mapping = {}

    @classmethod
    def get_name(cls) -> str:
        raise NotImplementedError(f"{cls.__qualname__} must implement get_name()")

    def get_supported_act_dtypes(self) -> list[Any]:
        """The activation dtypes the method runs with; the worker refuses a model dtype outside them."""
        from asyncengine.interfaces.torch_bases import float_dtypes  # (the floor's one torch module)

        return float_dtypes()

    @classmethod
    def get_min_capability(cls) -> int:
        """vLLM's: the lowest CUDA compute capability (major * 10 + minor) the method runs on. Checked where
        the platform reports a capability (a CUDA platform); 0: no minimum."""
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        """vLLM's: files in the model directory holding the method's config, when config.json's
        `quantization_config` does not (read by `quantization_config_for`); none by default."""
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """vLLM's: the instance for the checkpoint's quantization config (a dict; {} when it has none)."""
        return cls()

    @classmethod
    def from_model_config(cls, hf_config: Any) -> QuantizationConfig:
        """Ours: the instance for the model's whole config. Defaults to vLLM's `from_config` with the
        checkpoint's `quantization_config`."""
        return cls.from_config(checkpoint_quantization_config(hf_config) or {})

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None) -> str | None:
        """vLLM's: given a checkpoint's quantization config and the user's `quantization`, the name of this
        method when it should serve that checkpoint instead; None: no claim. Asked of every registered method
        in registration order (`resolve_quantization_name`)."""
        return None

    @classmethod
    def verify_config(cls, engine_config: Any, hf_config: Any) -> None:
        """Called in the frontend, once the model's config is known and before anything is spawned, with
        the engine options and the model's config as attributes (what `from_model_config` gets): raise
        ConfigError to refuse what the method cannot hold (a dtype, a layer width, a tensor-parallel
        size). Accepts everything by default."""

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Any:
        """The method for `layer` (a ColumnParallelLinear or RowParallelLinear): a `LinearMethod` (ours), a
        `LinearMethodBase` (vLLM's shape, run through an adapter) or None (unquantized). `prefix` is the
        layer's name in the model where the model passes it ("" in the built-in models)."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement get_quant_method(layer, prefix)")

    def get_cache_scale(self, name: str) -> str | None:
        """vLLM's: the parameter a KV-cache scale in the checkpoint loads into; none here (no quantized KV)."""
        return None

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        """vLLM's: rename the layer names the config lists to the model's; our models keep the checkpoint's."""

    def maybe_update_config(self, model_name: str, revision: str | None = None) -> None:
        """vLLM's: refine the config from the model's files; nothing by default."""

    @staticmethod
    def get_from_keys(config: dict[str, Any], keys: list[str]) -> Any:
        """vLLM's helper: the value of the first of `keys` present in `config`."""
        for key in keys:
            if key in config:
                return config[key]
        raise ModelLoadError(f"the checkpoint's quantization config has none of the keys {keys}")

    @staticmethod
    def get_from_keys_or(config: dict[str, Any], keys: list[str], default: Any) -> Any:
        try:
            return QuantizationConfig.get_from_keys(config, keys)
        except ModelLoadError:
            return default


class QuantizeMethodBase:
    """vLLM's base of a layer's quantization method: `create_weights`, `apply`, `process_weights_after_loading`."""

    def create_weights(self, layer: nn.Module, *weight_args: Any, **extra_weight_attrs: Any) -> None:
        raise NotImplementedError(f"{type(self).__qualname__} must implement create_weights")

    def apply(self, layer: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__qualname__} must implement apply")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once every weight is loaded (quantize, repack, transpose, ...); nothing by default."""


class LinearMethodBase(QuantizeMethodBase):
    """vLLM's linear method, which our linear layers run through an adapter (models/layers/vllm_linear.py):

    - `create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
      params_dtype, **extra_weight_attrs)` registers `layer.weight`, shaped `(sum(output_partition_sizes),
      input_size_per_partition)`, which the checkpoint's float rows fill (any dtype they can be copied
      into), and any other parameters, which the method computes (in `process_weights_after_loading`);
      `extra_weight_attrs` holds `weight_loader`;
    - `apply(layer, x, bias=None)` computes the layer's output (a RowParallelLinear passes no bias and adds it
      after the all-reduce);
    - `process_weights_after_loading(layer)` may replace the weights (an online quantization's int8 and scales).
    """

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        raise NotImplementedError(f"{type(self).__qualname__} must implement create_weights")

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__qualname__} must implement apply")


class LinearBase(abc.ABC):  # noqa: B024 (a marker: nothing to implement)
    """vLLM's base of the linear layers, for `isinstance(layer, LinearBase)` in a method's get_quant_method:
    our ColumnParallelLinear and RowParallelLinear are registered as its subclasses (models/layers/linear.py)."""


def checkpoint_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """config.json's `quantization_config` (a dict, or an object with to_dict), None when it has none."""
    found = getattr(hf_config, "quantization_config", None)
    if found is None:
        return None
    if hasattr(found, "to_dict"):
        found = found.to_dict()
    if not isinstance(found, dict):
        raise ModelLoadError(f"config.json's quantization_config is {type(found).__name__}, not an object")
    return dict(found)


def quantization_config_for(cls: type[QuantizationConfig], hf_config: Any, model_dir: Any) -> QuantizationConfig:
    """The instance the worker builds the model with, as vLLM's loader builds it: config.json's
    quantization_config, else the first of the method's `get_config_filenames()` in the model directory (JSON),
    else {} when it names no files (a method naming files none of which is there is refused, as vLLM does)."""
    if cls.from_model_config.__func__ is not QuantizationConfig.from_model_config.__func__:  # type: ignore[attr-defined]
        with plugin_hook(cls, "from_model_config"):
            return cls.from_model_config(hf_config)  # ours: the whole model config
    found = checkpoint_quantization_config(hf_config)
    if found is None:
        filenames = list(cls.get_config_filenames())
        for filename in filenames:
            path = Path(model_dir) / filename
            if path.is_file():
                try:
                    found = json.loads(path.read_text())
                except ValueError as exc:
                    raise ModelLoadError(f"{path}, the config of quantization method {cls.get_name()!r}, is not "
                                         f"JSON: {exc}") from exc
                break
        else:
            if filenames:
                raise ModelLoadError(f"quantization method {cls.get_name()!r} reads its config from one of "
                                     f"{filenames} in the model directory, and {model_dir} has none of them (nor "
                                     "does config.json have a quantization_config)")
    with plugin_hook(cls, "from_config"):
        return cls.from_config(found or {})


@reads("quantization", "frontend")  # the name checked before anything starts
@reads("quantization", "worker")  # the name the model is built with
def resolve_quantization_name(user_quant: str | None, hf_config: Any) -> str | None:
    """The method that builds the model, as vLLM decides it: a method whose `override_quantization_method`
    claims the checkpoint wins (asked in registration order); else the user's `quantization`; else the
    checkpoint's `quant_method` when a plugin registered a method by that name (the built-in models otherwise
    load float checkpoints only, so a checkpoint naming an unknown method keeps the user's choice)."""
    found = checkpoint_quantization_config(hf_config)
    if found is None:
        return user_quant
    for name in QuantizationRegistry.keys():
        if QuantizationRegistry.get(name).owner == BUILT_IN:  # type: ignore[union-attr]
            continue
        cls = QuantizationRegistry.load(name)
        with plugin_hook(cls, "override_quantization_method"):
            claimed = cls.override_quantization_method(found, user_quant)
        if claimed is not None:
            return claimed
    if user_quant is None:
        named = found.get("quant_method")
        entry = QuantizationRegistry.get(named) if isinstance(named, str) else None
        if entry is not None and entry.owner != BUILT_IN:
            return named
    return user_quant


# -- the table of methods -------------------------------------------------------------------------------


QuantizationRegistry: Registry[type[QuantizationConfig]] = Registry(
    "quantization", "quantization method", QuantizationConfig, field="quantization",
    unknown="quantization {key!r} names no quantization method; known: {known} (a plugin adds one with "
            "register_quantization_config)")
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
    """Each linear layer's method, once every weight is loaded; a plugin's method that raises is named."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, LinearMethod):
            with plugin_hook(getattr(method, "plugin_method", method), "process_weights_after_loading"):
                method.process_weights_after_loading(module)


__all__ = ["LinearBase", "LinearMethod", "LinearMethodBase", "QuantizationConfig", "QuantizationRegistry",
           "QuantizeMethodBase", "building_with", "checkpoint_quantization_config", "process_weights_after_loading",
           "quantization_config_for", "resolve_quantization_name"]
