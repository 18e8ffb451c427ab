"""Build the model class for a ModelConfig and fill its weights, through the loader `load_format` names."""

from __future__ import annotations

import torch
from torch import nn

from asyncengine.config.model import ModelConfig
from asyncengine.loader.registry import LoadConfig, ModelLoaderRegistry
from asyncengine.registries.base import reads


@reads("model_loaders", "worker")
def load_model(
    model_config: ModelConfig,
    *,
    device: torch.device,
    load_format: str = "auto",
    model_class_overrides: dict[str, str] | None = None,
    seed: int = 0,
    quantization: str | None = None,
) -> nn.Module:
    loader_cls = ModelLoaderRegistry.loader_class(load_format)
    loader = loader_cls(LoadConfig(load_format=load_format, seed=seed, model_class_overrides=model_class_overrides,
                                   quantization=quantization))
    return loader.load_model(model_config, device)
