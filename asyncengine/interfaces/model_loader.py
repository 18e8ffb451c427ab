"""Model loaders, the interface: `--load-format NAME` picks the class that fills a model's weights
(EXTENSION_POINTS.md, model loaders), and the table of loaders.

A loader is a BaseModelLoader subclass registered with `@register_model_loader("name")`, from a general
plugin so that every process has it. Read in the worker, which builds the model; the frontend checks
the name before anything starts, so a typo fails at once, listing the loaders it knows. The built-ins
(`safetensors`, `gguf`, `dummy`, in asyncengine/loader/registry.py) are in the table by path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncengine.config.model import ModelConfig
from asyncengine.errors import ConfigError, ModelLoadError
from asyncengine.interfaces.imports import import_by_path
from asyncengine.interfaces.models import ModelRegistry
from asyncengine.interfaces.quantization import QuantizationRegistry, building_with, process_weights_after_loading
from asyncengine.interfaces.registry import BUILT_IN, Registry, reads

if TYPE_CHECKING:
    import torch
    from torch import nn

AUTO = "auto"


@dataclass(frozen=True)
class LoadConfig:
    """What a loader may need beyond the model: the seed (for random weights) and class overrides."""

    load_format: str
    seed: int = 0
    model_class_overrides: dict[str, str] | None = None
    quantization: str | None = None  # a QuantizationConfig's registered name: builds the linear layers


class BaseModelLoader:
    """Build the model for a ModelConfig and fill its weights. Subclasses implement `load_weights`;
    `load_model` (build on the device, fill, eval) is rarely worth overriding."""

    def __init__(self, load_config: LoadConfig) -> None:
        self.load_config = load_config

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        raise NotImplementedError(f"{type(self).__qualname__} must implement load_weights(model, model_config)")

    @reads("models", "worker")
    @reads("hook:model_class_overrides", "worker")
    @reads("quantization", "worker")  # the QuantizationConfig that builds the linear layers
    def load_model(self, model_config: ModelConfig, device: torch.device) -> nn.Module:
        from asyncengine.interfaces.torch_bases import build_on_device  # torch, when a model is built

        _, model_cls = ModelRegistry.resolve(model_config.architectures, self.load_config.model_class_overrides)
        if model_config.runner == "pooling" and not getattr(model_cls, "is_pooling_model", False):
            # A generation model run as an embedder (--runner pooling): the same layers, no LM head.
            adapt = import_by_path("asyncengine.models.pooling_adapters:as_pooling_model", what="pooling adapter",
                                   error=ModelLoadError)
            model_cls = adapt(model_cls)
        hf_config = model_config.load_hf_config()
        quant_config = None
        if self.load_config.quantization is not None:
            quant_config = QuantizationRegistry.config_class(self.load_config.quantization).from_model_config(hf_config)
        with building_with(quant_config):
            model = build_on_device(model_cls, hf_config, dtype=model_config.dtype, device=device,
                                    max_position=model_config.max_model_len)
        self.load_weights(model, model_config)
        process_weights_after_loading(model)
        return model.eval()


# -- the table of loaders ---------------------------------------------------------------------------------


class _ModelLoaderRegistry(Registry):
    def __init__(self) -> None:
        super().__init__("model_loaders", "model loader")

    def register_loader(self, load_format: str, loader: Any, *, override: bool = False) -> None:
        self.register(load_format, loader, override=override)

    def loader_class(self, load_format: str) -> type[BaseModelLoader]:
        """The loader for `load_format` ("auto": safetensors); unknown names list the known ones."""
        name = "safetensors" if load_format == AUTO else load_format
        entry = self.get(name)
        if entry is None:
            raise ConfigError(f"load_format {load_format!r} names no model loader; known: {AUTO}, "
                              f"{', '.join(self.keys())} (a plugin adds one with register_model_loader)",
                              field="load_format")
        loader = entry.implementation
        if isinstance(loader, str):
            loader = import_by_path(loader, what=f"model loader {name!r}", error=ModelLoadError)
        if not (isinstance(loader, type) and issubclass(loader, BaseModelLoader)):
            raise ConfigError(f"model loader {name!r} is {loader!r} (registered by {entry.owner}), not a "
                              "BaseModelLoader subclass", field="load_format")
        return loader


ModelLoaderRegistry = _ModelLoaderRegistry()


ModelLoaderRegistry = _ModelLoaderRegistry()
# By path, so that the table imports no torch: the built-ins' classes, which the worker builds.
for _name, _class in (("safetensors", "SafetensorsLoader"), ("gguf", "GgufLoader"), ("dummy", "DummyLoader")):
    ModelLoaderRegistry.register(_name, f"asyncengine.loader.registry:{_class}", owner=BUILT_IN)


__all__ = ["AUTO", "BaseModelLoader", "LoadConfig", "ModelLoaderRegistry"]
