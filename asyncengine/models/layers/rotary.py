"""Rotary position embedding (RoPE), with the scaling variants Llama-family checkpoints use.

`RotaryEmbedding` is a custom op (custom_op.py): replaceable by name ("RotaryEmbedding"), and its
rotation runs through the providers of op "rotary" (`rotary_native` is the reference). Unlike vLLM's
`forward(positions, query, key)`, it takes the step's cos/sin, looked up once per step (`lookup`)
and shared by every layer. Its constructor takes ours or vLLM's arguments (RotaryEmbedding's docstring).
"""

from __future__ import annotations

import functools
import inspect
import math
from contextvars import ContextVar
from typing import Any

import torch

from asyncengine.errors import ModelLoadError
from asyncengine.models.layers.custom_op import CustomOp
from asyncengine.models.layers.op_registry import call_op, native_first
from asyncengine.ops import cpu_fused

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


# The two constructors: ours, and vLLM's RotaryEmbedding's (an out-of-tree replacement written for vLLM
# declares and passes these).
_P = inspect.Parameter
_OURS = inspect.Signature([_P(name, _P.POSITIONAL_OR_KEYWORD) for name in ("head_dim", "max_position", "params")])
_VLLMS = inspect.Signature([_P(name, _P.POSITIONAL_OR_KEYWORD) for name in
                            ("head_size", "rotary_dim", "max_position_embeddings", "base", "is_neox_style", "dtype")])
# The model's full rope settings while it builds a replacement that takes vLLM's arguments: vLLM's
# constructor has only `base`, its scaled variants being subclasses, so the scaling travels here.
_building_with: ContextVar[dict[str, Any] | None] = ContextVar("asyncengine_rotary_params", default=None)


def rotary_arguments(args: tuple, kwargs: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
    """(head_dim, max_position, rope params) from ours, `(head_dim, max_position, params)`, or vLLM's,
    `(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)`."""
    try:
        ours = _OURS.bind(*args, **kwargs).arguments
        return int(ours["head_dim"]), int(ours["max_position"]), dict(ours["params"])
    except TypeError:
        pass
    try:
        vllm = _VLLMS.bind(*args, **kwargs).arguments
    except TypeError as exc:
        raise TypeError(f"RotaryEmbedding takes (head_dim, max_position, params), or vLLM's (head_size, rotary_dim, "
                        f"max_position_embeddings, base, is_neox_style, dtype): {exc}") from None
    if vllm["rotary_dim"] != vllm["head_size"]:
        raise ModelLoadError(f"RotaryEmbedding(rotary_dim={vllm['rotary_dim']}, head_size={vllm['head_size']}): "
                             "partial rotary (rotary_dim < head_size) is not supported here")
    if not vllm["is_neox_style"]:
        raise ModelLoadError("RotaryEmbedding(is_neox_style=False): only the NeoX rotation (rotate halves, as "
                             "Llama, Qwen2 and Qwen3 use) is supported here, not GPT-J's interleaved one")
    building = _building_with.get()
    if building is not None and float(building["rope_theta"]) == float(vllm["base"]):
        params = dict(building)
    else:
        params = {"rope_theta": float(vllm["base"]), "rope_type": "default"}
    return int(vllm["head_size"]), int(vllm["max_position_embeddings"]), params


def _takes_vllms_arguments(init: Any) -> bool:
    try:
        return list(inspect.signature(init).parameters)[1:3] == ["head_size", "rotary_dim"]
    except (TypeError, ValueError):
        return False


def _accepting_ours(init: Any) -> Any:
    """`init` (a replacement's vLLM-shaped __init__) also called with our arguments, as the model calls it."""

    @functools.wraps(init)
    def construct(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            ours = _OURS.bind(*args, **kwargs).arguments
        except TypeError:
            return init(self, *args, **kwargs)  # vLLM's arguments already (a subclass's super().__init__)
        head_dim, params = int(ours["head_dim"]), dict(ours["params"])
        token = _building_with.set(params)
        try:
            init(self, head_dim, head_dim, int(ours["max_position"]), float(params["rope_theta"]), True,
                 torch.get_default_dtype())
        finally:
            _building_with.reset(token)

    return construct


@CustomOp.register("RotaryEmbedding")
class RotaryEmbedding(CustomOp):
    """Rotates query and key heads by their positions, reading cos/sin from a table built once.

    Built as `RotaryEmbedding(head_dim, max_position, params)` (the model's call) or with vLLM's
    arguments `(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)`; a
    replacement whose __init__ declares vLLM's is given vLLM's (and our rope scaling reaches the base)."""

    cos_table: torch.Tensor  # buffers (register_buffer), [max_position, head_dim]
    sin_table: torch.Tensor

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and _takes_vllms_arguments(init):
            cls.__init__ = _accepting_ours(init)  # type: ignore[method-assign]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        head_dim, max_position, params = rotary_arguments(args, kwargs)
        # vLLM's attribute names, which a replacement written for vLLM may read.
        self.head_size = self.rotary_dim = head_dim
        self.max_position_embeddings = max_position
        self.base = float(params["rope_theta"])
        self.is_neox_style = True
        self.dtype = kwargs.get("dtype", args[5] if len(args) == 6 else torch.get_default_dtype())
        inv_freq = _inverse_frequencies(head_dim, params)
        angles = torch.arange(max_position, dtype=torch.float).unsqueeze(1) * inv_freq.unsqueeze(0)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos_table", angles.cos(), persistent=False)
        self.register_buffer("sin_table", angles.sin(), persistent=False)

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        """vLLM's `[max_position, rotary_dim]` table: the cosines then the sines of each position's half angles."""
        half = self.rotary_dim // 2
        return torch.cat((self.cos_table[:, :half], self.sin_table[:, :half]), dim=-1)

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

    def forward_cpu(
        self, query: torch.Tensor, key: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_native` as one fused kernel (reading `query` and `key` where they lie, views of the
        fused QKV projection's output), under the conditions of RMSNorm.forward_cpu (norm.py)."""
        cos, sin = cos_sin
        if (type(self).forward_native is RotaryEmbedding.forward_native and native_first("rotary")
                and cpu_fused.rotary_supported(query, key, cos, sin)):
            return cpu_fused.rotary(query, key, cos, sin)
        return self.forward_native(query, key, cos_sin)


def rotary_native(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin
