"""Model loaders, the interface: `--load-format NAME` picks the class that fills a model's weights
(docs/reference.md, model loaders), and the table of loaders.

A loader is a BaseModelLoader subclass registered with `@register_model_loader("name")`, from a general
plugin so that every process has it. Read in the worker, which builds the model; the frontend checks
the name before anything starts, so a typo fails at once, listing the loaders it knows. The built-ins
(`safetensors`, `gguf`, `dummy`, in asyncengine/loader/registry.py) are in the table by path.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncengine.config.model import TRANSFORMERS, ModelConfig
from asyncengine.errors import ModelLoadError
from asyncengine.interfaces.imports import import_by_path
from asyncengine.interfaces.models import ModelRegistry
from asyncengine.interfaces.plugin_code import plugin_hook
from asyncengine.interfaces.quantization import (
    QuantizationRegistry,
    building_with,
    process_weights_after_loading,
    quantization_config_for,
    resolve_quantization_name,
)
from asyncengine.interfaces.registry import BUILT_IN, Registry, reads

if TYPE_CHECKING:
    import torch
    from torch import nn

AUTO = "auto"

# The model class of ModelConfig.model_impl "transformers", by path (this floor module imports no models).
TRANSFORMERS_BACKEND = "asyncengine.models.transformers_backend:TransformersForCausalLM"


@dataclass(frozen=True)
class LoadConfig:
    """What a loader may need beyond the model, with vLLM's field names: `load_format`, `download_dir`,
    `model_loader_extra_config` (the option of that name: the loader's own settings), `device` (None: the
    worker's), `ignore_patterns`; and ours: the seed (for random weights), class overrides, quantization."""

    load_format: str
    seed: int = 0
    model_class_overrides: dict[str, str] | None = None
    quantization: str | None = None  # a QuantizationConfig's registered name: builds the linear layers
    download_dir: str | None = None
    model_loader_extra_config: dict[str, Any] = field(default_factory=dict)
    device: str | None = None
    ignore_patterns: list[str] = field(default_factory=lambda: ["original/**/*"])
    use_tqdm_on_load: bool = False


# The device the worker loads onto, while loader.model_loader.load_model runs a loader (vLLM's form of
# load_model takes no device: it reads vllm_config.device_config, which here names the platform, not a rank).
loading_device: contextvars.ContextVar[Any] = contextvars.ContextVar("asyncengine_loading_device", default=None)


def _is_vllm_config(value: Any) -> bool:
    return hasattr(value, "parallel_config") and hasattr(value, "load_config")


class BaseModelLoader:
    """Build the model for a ModelConfig and fill its weights. Subclasses implement `load_weights(model,
    model_config)`; `load_model` (build on the device, fill, eval) is rarely worth overriding.

    vLLM's shapes work too: `download_model(model_config)` (called before load_model; the files are local
    here, so the default does nothing), and `load_model(vllm_config, model_config)`, which a vLLM loader
    overrides and whose base builds and fills the model as ours does."""

    def __init__(self, load_config: LoadConfig) -> None:
        self.load_config = load_config

    def download_model(self, model_config: ModelConfig) -> None:
        """vLLM's: fetch the model's files. The frontend resolved (and fetched) them before any worker starts."""

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        raise NotImplementedError(f"{type(self).__qualname__} must implement load_weights(model, model_config)")

    def load_model(self, *args: Any, **kwargs: Any) -> nn.Module:
        """Ours: `load_model(model_config, device)`; vLLM's: `load_model(vllm_config, model_config, prefix="")`."""
        if kwargs.get("vllm_config") is not None or (args and _is_vllm_config(args[0])):
            vllm_config = kwargs.pop("vllm_config", None) or args[0]
            rest = args[1:] if args and _is_vllm_config(args[0]) else args
            model_config = kwargs.pop("model_config", None) or (rest[0] if rest else None)
            return self._build_and_fill(_ours(vllm_config, model_config), _device(self.load_config))
        model_config = kwargs.pop("model_config", None) or args[0]
        device = kwargs.pop("device", None) or (args[1] if len(args) > 1 else _device(self.load_config))
        return self._build_and_fill(model_config, device)

    @reads("models", "worker")
    @reads("hook:model_class_overrides", "worker")
    @reads("quantization", "worker")  # the QuantizationConfig that builds the linear layers
    def _build_and_fill(self, model_config: ModelConfig, device: torch.device) -> nn.Module:
        from asyncengine.interfaces.torch_bases import build_on_device  # torch, when a model is built

        hf_config: Any
        if model_config.model_impl == TRANSFORMERS:  # transformers' modelling code over our KV cache (docs/models.md)
            model_cls = import_by_path(TRANSFORMERS_BACKEND, what="the transformers backend", error=ModelLoadError)
            hf_config = model_cls.spec_of(model_config)
        else:
            _, model_cls = ModelRegistry.resolve(model_config.architectures, self.load_config.model_class_overrides)
            if model_config.runner == "pooling" and not getattr(model_cls, "is_pooling_model", False):
                # A generation model run as an embedder (--runner pooling): the same layers, no LM head.
                adapt = import_by_path("asyncengine.models.pooling_adapters:as_pooling_model",
                                       what="pooling adapter", error=ModelLoadError)
                model_cls = adapt(model_cls)
            hf_config = model_config.load_hf_config()
        quant_config = _quantization_config(self.load_config.quantization, hf_config, model_config)
        with building_with(quant_config):
            model = build_on_device(model_cls, hf_config, dtype=model_config.dtype, device=device,
                                    max_position=model_config.max_model_len)
        with plugin_hook(self, "load_weights"):
            self.load_weights(model, model_config)
        process_weights_after_loading(model)
        return model.eval()


@reads("quantization", "worker")
def _quantization_config(user_quant: str | None, hf_config: Any, model_config: ModelConfig) -> Any:
    """The QuantizationConfig the model is built with (None: unquantized), as vLLM's loader builds it
    (interfaces/quantization.py: the method's name, its config, its activation dtypes)."""
    name = resolve_quantization_name(user_quant, hf_config)
    if name is None:
        return None
    cls = QuantizationRegistry.load(name)
    quant_config = quantization_config_for(cls, hf_config, model_config.model_dir)
    with plugin_hook(quant_config, "get_supported_act_dtypes"):
        supported = [str(dtype).removeprefix("torch.") for dtype in quant_config.get_supported_act_dtypes()]
    if model_config.dtype not in supported:
        raise ModelLoadError(f"quantization method {name!r} runs with activations in {', '.join(supported)}, not the "
                             f"model's dtype {model_config.dtype}: set dtype to one of those")
    return quant_config


def _ours(vllm_config: Any, model_config: Any) -> ModelConfig:
    """Our ModelConfig from what vLLM's form of load_model was given (ours, or vLLM's view of it)."""
    if isinstance(model_config, ModelConfig):
        return model_config
    from asyncengine.config.vllm_views import resolved_model

    resolved = resolved_model(vllm_config)
    if resolved is None:
        raise ModelLoadError("load_model(vllm_config, model_config) was called before this process resolved the "
                             "model: call it from the engine's load (a worker), not by hand")
    return resolved


def _device(load_config: LoadConfig) -> Any:
    from asyncengine.interfaces.torch_bases import device  # the floor's one torch module

    if load_config.device is not None:
        return device(load_config.device)
    loading = loading_device.get()
    return loading if loading is not None else device("cpu")


# -- the table of loaders ---------------------------------------------------------------------------------


class _ModelLoaderRegistry(Registry[type[BaseModelLoader]]):
    def __init__(self) -> None:
        super().__init__("model_loaders", "model loader", BaseModelLoader, field="load_format",
                         unknown=f"load_format {{key!r}} names no model loader; known: {AUTO}, {{known}} (a plugin adds "
                                 "one with register_model_loader)")

    def register_loader(self, load_format: str, loader: Any, *, override: bool = False) -> None:
        """The name plugins call (asyncengine's own; vLLM registers with the register_model_loader decorator)."""
        self.register(load_format, loader, override=override)

    def loader_class(self, load_format: str) -> type[BaseModelLoader]:
        """The loader for `load_format` ("auto": safetensors); unknown names list the known ones."""
        return self.load("safetensors" if load_format == AUTO else load_format)


ModelLoaderRegistry = _ModelLoaderRegistry()
# By path, so that the table imports no torch: the built-ins' classes, which the worker builds.
for _name, _class in (("safetensors", "SafetensorsLoader"), ("gguf", "GgufLoader"), ("dummy", "DummyLoader")):
    ModelLoaderRegistry.register(_name, f"asyncengine.loader.registry:{_class}", owner=BUILT_IN)


__all__ = ["AUTO", "BaseModelLoader", "LoadConfig", "ModelLoaderRegistry"]
