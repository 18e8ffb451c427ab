"""A model class written as vLLM's are, run by this engine: `as_engine_model(cls)` is what the loader builds
for a registered class whose constructor takes vLLM's `vllm_config` (docs/porting.md, models).

vLLM builds a model as `cls(vllm_config=..., prefix="")` under the model's default dtype, calls
`forward(input_ids, positions, intermediate_tensors=None, inputs_embeds=None)` with the step's attention metadata
in a forward context, `compute_logits(hidden_states)` and `load_weights(weights)`. Ours builds a model as
`cls(hf_config, dtype=..., max_position=...)` and calls `forward(input_ids, positions, metadata)`. The adapter
is a subclass of the vLLM-shaped class (same parameters, same names: LoRA, quantization and the loaders see the
model's own modules) that takes our calls and makes vLLM's:

- `vllm_config`: `model_config` (`hf_config`, `hf_text_config`, `dtype`, `max_model_len`), `quant_config` (the
  quantization config the model is being built with, None when unquantized), `cache_config`, `lora_config`,
  `parallel_config` (None here: the layers read the rank themselves), `compilation_config`;
- the forward context: vLLM's `Attention` layers (models/layers/vllm_attention.py) read the step's metadata.
"""

from __future__ import annotations

import inspect
from functools import cache
from types import SimpleNamespace
from typing import Any

import torch

from asyncengine.interfaces.quantization import current_quantization_config
from asyncengine.models.layers.vllm_attention import forward_context


def is_vllm_model_class(cls: Any) -> bool:
    """Whether `cls`'s constructor takes vLLM's `vllm_config` (by keyword: vLLM passes it so)."""
    try:
        return "vllm_config" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def vllm_config_for(hf_config: Any, dtype: torch.dtype, max_position: int) -> SimpleNamespace:
    """What a vLLM model's constructor reads of its `vllm_config` (module docstring)."""
    model_config = SimpleNamespace(hf_config=hf_config, hf_text_config=hf_config, dtype=dtype,
                                   max_model_len=max_position)
    return SimpleNamespace(model_config=model_config, quant_config=current_quantization_config(), cache_config=None,
                           lora_config=None, parallel_config=None, compilation_config=None)


@cache
def as_engine_model(cls: Any) -> Any:
    """`cls` (vLLM-shaped) taking this engine's constructor and forward calls."""

    def __init__(self: Any, config: Any, *, dtype: torch.dtype, max_position: int) -> None:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # vLLM builds under the model's dtype: layers given no dtype take it
        try:
            cls.__init__(self, vllm_config=vllm_config_for(config, dtype, max_position), prefix="")
        finally:
            torch.set_default_dtype(previous)

    def forward(self: Any, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        with forward_context(metadata):
            return cls.forward(self, input_ids, positions)

    def compute_logits(self: Any, hidden: torch.Tensor) -> torch.Tensor:
        return cls.compute_logits(self, hidden)

    return type(cls.__name__, (cls,), {
        "__init__": __init__, "forward": forward, "compute_logits": compute_logits, "__module__": cls.__module__,
        "__qualname__": cls.__qualname__, "__doc__": cls.__doc__, "vllm_model_class": cls})


__all__ = ["as_engine_model", "is_vllm_model_class", "vllm_config_for"]
