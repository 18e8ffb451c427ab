"""Model loaders: `--load-format NAME` picks the class that fills a model's weights (EXTENSION_POINTS.md, R5).

The built-ins (`safetensors`, `gguf`, `dummy`) register here in code, through the same door a plugin
uses: `@register_model_loader("name")` on a BaseModelLoader subclass, from a general plugin so that
every process has it. Read in the worker, which builds the model; the frontend checks the name
before anything starts, so a typo fails at once, listing the loaders it knows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncengine.config.model import ModelConfig
from asyncengine.errors import ConfigError
from asyncengine.registries.base import BUILT_IN, Registry, reads

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
        import torch  # here, not at import: plugins import this module through plugins_api

        from asyncengine.models.layers.quantization import (
            QuantizationRegistry,
            building_with,
            process_weights_after_loading,
        )
        from asyncengine.models.registry import ModelRegistry

        _, model_cls = ModelRegistry.resolve(model_config.architectures, self.load_config.model_class_overrides)
        hf_config = model_config.load_hf_config()
        quant_config = None
        if self.load_config.quantization is not None:
            quant_config = QuantizationRegistry.config_class(self.load_config.quantization).from_model_config(hf_config)
        with torch.device(device), building_with(quant_config):
            model = model_cls(hf_config, dtype=getattr(torch, model_config.dtype),
                              max_position=model_config.max_model_len)
        self.load_weights(model, model_config)
        process_weights_after_loading(model)
        return model.eval()


class _ModelLoaderRegistry(Registry):
    def __init__(self) -> None:
        super().__init__("model_loaders", "model loader")

    def register_loader(self, load_format: str, loader: Any, *, override: bool = False) -> None:
        self.register(load_format, loader, override=override)

    def loader_class(self, load_format: str) -> type[BaseModelLoader]:
        """The loader for `load_format` ("auto": safetensors); unknown names list the known ones."""
        from asyncengine.models.registry import import_by_path

        name = "safetensors" if load_format == AUTO else load_format
        entry = self.get(name)
        if entry is None:
            raise ConfigError(f"load_format {load_format!r} names no model loader; known: {AUTO}, "
                              f"{', '.join(self.keys())} (a plugin adds one with register_model_loader)",
                              field="load_format")
        loader = entry.implementation
        if isinstance(loader, str):
            loader = import_by_path(loader, what=f"model loader {name!r}")
        if not (isinstance(loader, type) and issubclass(loader, BaseModelLoader)):
            raise ConfigError(f"model loader {name!r} is {loader!r} (registered by {entry.owner}), not a "
                              "BaseModelLoader subclass", field="load_format")
        return loader


ModelLoaderRegistry = _ModelLoaderRegistry()


def register_model_loader(load_format: str, *, override: bool = False) -> Callable[[type], type]:
    """Class decorator: `@register_model_loader("my_format")` on a BaseModelLoader subclass."""

    def register(cls: type) -> type:
        ModelLoaderRegistry.register_loader(load_format, cls, override=override)
        return cls

    return register


# -- the built-ins ----------------------------------------------------------------------------------------


class SafetensorsLoader(BaseModelLoader):
    """*.safetensors in the model directory (sharded or not)."""

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        from asyncengine.loader.safetensors_weights import find_weight_files, iterate_weights

        model.load_weights(iterate_weights(find_weight_files(Path(model_config.model_dir))))


class GgufLoader(SafetensorsLoader):
    """A GGUF model: the frontend converts the .gguf file once into a cached directory of safetensors
    (dequantized, Q/K rows un-permuted; see loader/gguf.py), which the worker then reads."""


class DummyLoader(BaseModelLoader):
    """Random weights, for benchmarks and tests: normal(0, 0.02) matrices, unit norms, zero biases."""

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        import torch

        generator = torch.Generator(device="cpu").manual_seed(self.load_config.seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                module_name, _, leaf = name.rpartition(".")
                method = getattr(model.get_submodule(module_name), "quant_method", None)
                if leaf in getattr(method, "computed_parameters", ()):
                    continue  # a quantization scale: set with its weight below
                if name.endswith("bias"):
                    param.zero_()
                elif param.dim() == 1:
                    param.fill_(1.0)
                else:
                    values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)
                    if method is not None and leaf == "weight":  # through the layer's (quantization) method
                        method.load_weight_rows(model.get_submodule(module_name), 0, values)
                    else:
                        param.copy_(values)


for _name, _loader in (("safetensors", SafetensorsLoader), ("gguf", GgufLoader), ("dummy", DummyLoader)):
    ModelLoaderRegistry.register(_name, _loader, owner=BUILT_IN)
