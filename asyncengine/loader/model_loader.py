"""Build the model class for a ModelConfig and fill its weights, through the loader `load_format` names.

A loader written against vLLM's BaseModelLoader is driven as vLLM drives it: `download_model(model_config)`,
then `load_model(vllm_config, model_config)` when its class overrides load_model in that form (ours is
`load_model(model_config, device)`). What a plugin's loader raises is named with its distribution, the
method and the process (plugin_runtime/plugin_code.py)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from asyncengine.config.model import ModelConfig
from asyncengine.interfaces.model_loader import loading_device
from asyncengine.interfaces.model_loader import BaseModelLoader, LoadConfig, ModelLoaderRegistry
from asyncengine.interfaces.plugin_code import plugin_hook
from asyncengine.interfaces.registry import reads

if TYPE_CHECKING:
    from asyncengine.config.engine import EngineConfig


@reads("model_loaders", "worker")
def load_model(
    model_config: ModelConfig,
    *,
    device: torch.device,
    load_format: str = "auto",
    model_class_overrides: dict[str, str] | None = None,
    seed: int = 0,
    quantization: str | None = None,
    engine_config: EngineConfig | None = None,
) -> nn.Module:
    """`engine_config` (the worker's) gives vLLM's LoadConfig fields, and is the `vllm_config` a loader in
    vLLM's form is given."""
    loader_cls = ModelLoaderRegistry.loader_class(load_format)
    load_config = LoadConfig(
        load_format=load_format, seed=seed, model_class_overrides=model_class_overrides, quantization=quantization,
        download_dir=getattr(engine_config, "download_dir", None),
        model_loader_extra_config=dict(getattr(engine_config, "model_loader_extra_config", None) or {}))
    with plugin_hook(loader_cls, "__init__"):
        loader = loader_cls(load_config)
    token = loading_device.set(device)
    try:
        with plugin_hook(loader, "download_model"):
            loader.download_model(model_config)
        with plugin_hook(loader, "load_model"):
            if engine_config is not None and _takes_vllm_config(loader):
                return loader.load_model(engine_config, engine_config.model_config)
            return loader.load_model(model_config, device)
    finally:
        loading_device.reset(token)


def _takes_vllm_config(loader: BaseModelLoader) -> bool:
    """Whether the loader's class overrides load_model in vLLM's form, `load_model(vllm_config, model_config)`."""
    method = type(loader).load_model
    if method is BaseModelLoader.load_model:
        return False
    parameters = [p for p in inspect.signature(method).parameters.values() if p.name != "self"]
    return bool(parameters) and parameters[0].name == "vllm_config"
