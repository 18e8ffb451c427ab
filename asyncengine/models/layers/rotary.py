"""Rotary position embedding (RoPE), with the scaling variants Llama-family checkpoints use.

`RotaryEmbedding` is a custom op (custom_op.py): replaceable by name ("RotaryEmbedding"), and its
rotation runs through the providers of op "rotary" (`rotary_native` is the reference). Unlike vLLM's
`forward(positions, query, key)`, it takes the step's cos/sin, looked up once per step (`lookup`)
and shared by every layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from asyncengine.errors import ModelLoadError
from asyncengine.models.layers.custom_op import CustomOp
from asyncengine.models.layers.op_registry import call_op

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings of a config, whichever way transformers spelled them.

    transformers 5 keeps them in `rope_parameters`; older config.json files have `rope_theta`
    and an optional `rope_scaling` dict.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        merged = dict(params)
    else:
        merged = dict(getattr(hf_config, "rope_scaling", None) or {})
        merged["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    merged.setdefault("rope_type", merged.pop("type", "default") or "default")
    return merged


def _inverse_frequencies(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    # Same expression as transformers, so positions rotate by bit-identical angles in float32.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float) / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params)
    raise ModelLoadError(
        f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


def _llama3_scaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's rule: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    original_context = float(params["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > original_context / low, inv_freq / factor, inv_freq)
    blend = (original_context / wavelength - low) / (high - low)
    blended = (1 - blend) * slowed / factor + blend * slowed
    in_between = (wavelength >= original_context / high) & (wavelength <= original_context / low)
    return torch.where(in_between, blended, slowed)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


@CustomOp.register("RotaryEmbedding")
class RotaryEmbedding(CustomOp):
    """Rotates query and key heads by their positions, reading cos/sin from a table built once."""

    cos_table: torch.Tensor  # buffers (register_buffer), [max_position, head_dim]
    sin_table: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        inv_freq = _inverse_frequencies(head_dim, params)
        angles = torch.arange(max_position, dtype=torch.float).unsqueeze(1) * inv_freq.unsqueeze(0)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos_table", angles.cos(), persistent=False)
        self.register_buffer("sin_table", angles.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, `[tokens, 1, head_dim]`: looked up once per step, used by every layer."""
        return (
            self.cos_table[positions].unsqueeze(1).to(dtype),
            self.sin_table[positions].unsqueeze(1).to(dtype),
        )

    def forward_native(
        self, query: torch.Tensor, key: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `query` `[tokens, heads, head_dim]` and `key` `[tokens, kv_heads, head_dim]` by their positions."""
        cos, sin = cos_sin
        return call_op("rotary", query, key, cos, sin)


def rotary_native(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin
