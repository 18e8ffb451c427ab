"""Build the model class for a ModelConfig and fill its weights (checkpoint or random)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from asyncengine.config.model import ModelConfig
from asyncengine.loader.safetensors_weights import find_weight_files, iterate_weights
from asyncengine.models.registry import ModelRegistry


def load_model(
    model_config: ModelConfig,
    *,
    device: torch.device,
    load_format: str = "auto",
    model_class_overrides: dict[str, str] | None = None,
    seed: int = 0,
) -> nn.Module:
    hf_config = model_config.load_hf_config()
    _, model_cls = ModelRegistry.resolve(model_config.architectures, model_class_overrides)
    dtype = getattr(torch, model_config.dtype)
    with torch.device(device):
        model = model_cls(hf_config, dtype=dtype, max_position=model_config.max_model_len)
    if load_format == "dummy":
        fill_random_weights(model, seed)
    else:
        model.load_weights(iterate_weights(find_weight_files(Path(model_config.model_dir))))
    return model.eval()


@torch.no_grad()
def fill_random_weights(model: nn.Module, seed: int) -> None:
    """Random weights for benchmarks and tests: normal(0, 0.02) matrices, unit norms, zero biases."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:
            param.fill_(1.0)
        else:
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)
            param.copy_(values)
