"""Model loaders: `--load-format NAME` picks the class that fills a model's weights (docs/reference.md).
The interface (BaseModelLoader, LoadConfig) and the table are in the floor,
asyncengine.interfaces.model_loader.

The built-ins (`safetensors`, `gguf`, `dummy`) are here, in the table by path; a plugin uses
`@register_model_loader("name")` on a BaseModelLoader subclass, from a general plugin so that every
process has it. Read in the worker, which builds the model; the frontend checks the name
before anything starts, so a typo fails at once, listing the loaders it knows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from asyncengine.config.model import ModelConfig
from asyncengine.interfaces.model_loader import BaseModelLoader, ModelLoaderRegistry

if TYPE_CHECKING:
    import torch
    from torch import nn


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

        # Every model defines load_weights(weights), ours and vLLM-shaped ones; nn.Module does not declare it, so
        # mypy reads it through Module.__getattr__ (a tensor or a submodule).
        model_dir = Path(model_config.model_dir)
        weights = iterate_weights(find_weight_files(model_dir))
        if any(getattr(getattr(module, "quant_method", None), "wants_gguf_blocks", False) for module in model.modules()):
            from asyncengine.loader.gguf_blocks import with_blocks

            weights = with_blocks(weights, model_dir)  # quantization="gguf": the linear weights as the file's blocks
        model.load_weights(weights)  # type: ignore[operator]


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



__all__ = ["DummyLoader", "GgufLoader", "SafetensorsLoader", "register_model_loader"]
