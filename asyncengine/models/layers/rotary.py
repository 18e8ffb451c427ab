"""Rotary position embedding (RoPE), with the scaling variants Llama-family checkpoints use.

`RotaryEmbedding` is a custom op (interfaces/torch_bases.py): replaceable by name ("RotaryEmbedding"), and its
rotation runs through the providers of op "rotary" (`rotary_native` is the reference). Our models call it with
the step's cos/sin, looked up once per step (`lookup`) and shared by every layer; a vLLM model file calls it as
vLLM's, `forward(positions, query, key)`, and builds it with `get_rope(...)`. Its constructor takes ours or
vLLM's arguments (RotaryEmbedding's docstring).
"""

from __future__ import annotations

import functools
import inspect
import math
from contextvars import ContextVar
from typing import Any

import torch

from asyncengine.errors import ModelLoadError
from asyncengine.interfaces.torch_bases import CustomOp
from asyncengine.models.layers.op_registry import call_op, native_first
from asyncengine.ops import cpu_fused

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of a config, whichever way transformers spelled them, with what the tables need
    from the rest of the config (`max_position_embeddings`, `partial_rotary_factor`).

    transformers 5 keeps them in `rope_parameters` (per layer type where the types differ: Gemma 3's local
    and global bases, `layer_type` picks one); older config.json files have `rope_theta` and an optional
    `rope_scaling` dict.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        merged = dict(params)
    else:
        merged = dict(getattr(hf_config, "rope_scaling", None) or {})
        merged["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    merged["rope_type"] = merged.pop("type", None) or merged.get("rope_type") or "default"
    if merged["rope_type"] in ("su", "yarn") and "short_factor" in merged:  # Phi-3's older names for longrope
        merged["rope_type"] = "longrope"
    merged.setdefault("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0)
    if getattr(hf_config, "max_position_embeddings", None) is not None:
        merged.setdefault("max_position_embeddings", hf_config.max_position_embeddings)
    if getattr(hf_config, "original_max_position_embeddings", None) is not None:
        merged.setdefault("original_max_position_embeddings", hf_config.original_max_position_embeddings)
    return merged


def rotary_dim_of(head_dim: int, params: dict[str, Any]) -> int:
    """The leading dimensions of each head that rotate (all unless `partial_rotary_factor` < 1: Phi-4-mini, GLM)."""
    return int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0))


def _exponents(rotary_dim: int) -> torch.Tensor:
    # Same expression as transformers, so positions rotate by bit-identical angles in float32.
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float) / rotary_dim


def _inverse_frequencies(rotary_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention factor: a scale on cos and sin) of the types whose rotation does not
    depend on the position's distance from the start; `_position_tables` handles the others."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** _exponents(rotary_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(rotary_dim, params)
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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _context_factor(params: dict[str, Any]) -> tuple[int, float]:
    """(the original context, the scaling factor): `factor`, or else how much longer the model's context is
    (Phi-3 and DeepSeek give `max_position_embeddings` and `original_max_position_embeddings` only)."""
    original = int(params["original_max_position_embeddings"])
    given = params.get("factor")
    return original, float(given) if given is not None else float(params["max_position_embeddings"]) / original


def _yarn(rotary_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: each frequency blended between interpolated (slowed by `factor`) and extrapolated (kept) by a
    linear ramp over the dimensions whose wavelength falls between `beta_fast` and `beta_slow` rotations of
    the original context; cos and sin scaled by the attention factor (transformers' formulas)."""
    base, (original, factor) = float(params["rope_theta"]), _context_factor(params)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(dtype=torch.float) / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _position_tables(rotary_dim: int, max_position: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """The angles `[max_position, rotary_dim / 2]` of each position, and the attention factor.

    For `dynamic` (NTK) and `longrope` the frequencies depend on how long the sequence is: transformers
    recomputes them for each forward pass from the longest position in it. Here each position gets the
    frequencies transformers gives the token at that position when it is decoded one at a time (the
    sequence is then that token's position + 1 long): identical to transformers up to the original context,
    and for every token generated past it; a prompt longer than the original context is rotated per
    position, where transformers rotates the whole prompt by its full length (docs/models.md)."""
    positions = torch.arange(max_position, dtype=torch.float)
    rope_type = params["rope_type"]
    if rope_type == "dynamic":
        base, factor = float(params["rope_theta"]), float(params["factor"])
        trained = float(params["max_position_embeddings"])
        lengths = torch.clamp(positions + 1, min=trained)  # transformers' max(seq_len, max_position_embeddings)
        bases = base * ((factor * lengths / trained) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        inv_freq = 1.0 / (bases.unsqueeze(1) ** _exponents(rotary_dim).unsqueeze(0))
        within = positions.unsqueeze(1) * (1.0 / (base ** _exponents(rotary_dim))).unsqueeze(0)  # unscaled there
        return torch.where((positions + 1 <= trained).unsqueeze(1), within, positions.unsqueeze(1) * inv_freq), 1.0
    if rope_type == "longrope":
        base, (original, factor) = float(params["rope_theta"]), _context_factor(params)
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        shape = base ** _exponents(rotary_dim)
        short = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * shape)
        long = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float32) * shape)
        beyond = (positions + 1 > original).unsqueeze(1)
        return torch.where(beyond, positions.unsqueeze(1) * long, positions.unsqueeze(1) * short), float(attention_factor)
    inv_freq, attention_factor = _inverse_frequencies(rotary_dim, params)
    return positions.unsqueeze(1) * inv_freq.unsqueeze(0), attention_factor


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


def rotary_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
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
    rotary_shape = {"partial_rotary_factor": vllm["rotary_dim"] / vllm["head_size"],
                    "is_neox_style": bool(vllm["is_neox_style"])}
    building = _building_with.get()
    if building is not None and float(building["rope_theta"]) == float(vllm["base"]):
        params = {**building, **rotary_shape}
    else:
        params = {"rope_theta": float(vllm["base"]), "rope_type": "default", **rotary_shape}
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
            init(self, head_dim, rotary_dim_of(head_dim, params), int(ours["max_position"]),
                 float(params["rope_theta"]), bool(params.get("is_neox_style", True)), torch.get_default_dtype())
        finally:
            _building_with.reset(token)

    return construct


@CustomOp.register("RotaryEmbedding")
class RotaryEmbedding(CustomOp):
    """Rotates query and key heads by their positions, reading cos/sin from a table built once.

    Built as `RotaryEmbedding(head_dim, max_position, params)` (the model's call) or with vLLM's
    arguments `(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)`; a
    replacement whose __init__ declares vLLM's is given vLLM's (and our rope scaling reaches the base)."""

    cos_table: torch.Tensor  # buffers (register_buffer), [max_position, rotary_dim]
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
        self.head_size = head_dim
        self.rotary_dim = rotary_dim_of(head_dim, params)
        self.max_position_embeddings = max_position
        self.base = float(params["rope_theta"])
        # NeoX rotates the two halves of the rotary dimensions against each other (Llama, Qwen, Gemma, Phi);
        # GPT-J's interleaved form rotates each even dimension with the odd one after it (GLM).
        self.is_neox_style = bool(params.get("is_neox_style", True))
        self.dtype = kwargs.get("dtype", args[5] if len(args) == 6 else torch.get_default_dtype())
        angles, attention_factor = _position_tables(self.rotary_dim, max_position, params)
        # Each angle twice, in the layout the rotation reads: halves side by side, or each beside itself.
        angles = (torch.cat((angles, angles), dim=-1) if self.is_neox_style
                  else angles.repeat_interleave(2, dim=-1))
        # YaRN's and LongRoPE's attention factor scales cos and sin (in float32, as transformers does).
        self.register_buffer("cos_table", angles.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_table", angles.sin() * attention_factor, persistent=False)

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        """vLLM's `[max_position, rotary_dim]` table: the cosines then the sines of each position's half angles."""
        half = self.rotary_dim // 2
        if self.is_neox_style:
            return torch.cat((self.cos_table[:, :half], self.sin_table[:, :half]), dim=-1)
        return torch.cat((self.cos_table[:, ::2], self.sin_table[:, ::2]), dim=-1)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, `[tokens, 1, rotary_dim]`: looked up once per step, used by every layer."""
        return (
            self.cos_table[positions].unsqueeze(1).to(dtype),
            self.sin_table[positions].unsqueeze(1).to(dtype),
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Ours, `(query, key, cos_sin)` with `[tokens, heads, head_dim]` heads; or vLLM's, `(positions, query,
        key)` with `[tokens, heads * head_size]` projections (the positions looked up here), returned alike."""
        if len(args) == 3 and not kwargs and isinstance(args[2], torch.Tensor):
            positions, query, key = args
            tokens = positions.numel()
            cos_sin = self.lookup(positions.reshape(-1), query.dtype)
            rotated_query, rotated_key = super().forward(query.view(tokens, -1, self.head_size),
                                                         key.view(tokens, -1, self.head_size), cos_sin)
            return rotated_query.reshape(query.shape), rotated_key.reshape(key.shape)
        return super().forward(*args, **kwargs)

    def forward_native(
        self, query: torch.Tensor, key: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `query` `[tokens, heads, head_dim]` and `key` `[tokens, kv_heads, head_dim]` by their positions:
        the NeoX rotation through the providers of op "rotary", GPT-J's here."""
        cos, sin = cos_sin
        rotate = (lambda q, k: call_op("rotary", q, k, cos, sin)) if self.is_neox_style else \
            (lambda q, k: rotary_interleaved_native(q, k, cos, sin))
        return self._partial(rotate, query, key)

    def forward_cpu(
        self, query: torch.Tensor, key: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_native` as one fused kernel (reading `query` and `key` where they lie, views of the
        fused QKV projection's output), under the conditions of RMSNorm.forward_cpu (norm.py); the NeoX
        rotation only."""
        cos, sin = cos_sin
        if (type(self).forward_native is RotaryEmbedding.forward_native and self.is_neox_style
                and native_first("rotary")):
            if self.rotary_dim == query.shape[-1]:
                if cpu_fused.rotary_supported(query, key, cos, sin):
                    return cpu_fused.rotary(query, key, cos, sin)
            elif cpu_fused.rotary_supported(query[..., :self.rotary_dim], key[..., :self.rotary_dim], cos, sin):
                return self._partial(lambda q, k: cpu_fused.rotary(q, k, cos, sin), query, key)
        return self.forward_native(query, key, cos_sin)

    def _partial(self, rotate: Any, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotate` on the leading `rotary_dim` dimensions of each head, the rest passed through (partial rotary)."""
        rotary_dim = self.rotary_dim
        if rotary_dim == query.shape[-1]:
            return rotate(query, key)
        query_rot, key_rot = rotate(query[..., :rotary_dim], key[..., :rotary_dim])
        return (torch.cat((query_rot, query[..., rotary_dim:]), dim=-1),
                torch.cat((key_rot, key[..., rotary_dim:]), dim=-1))


def get_rope(head_size: int, rotary_dim: int, max_position: int, base: float, is_neox_style: bool = True,
             rope_scaling: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
             partial_rotary_factor: float = 1.0) -> RotaryEmbedding:
    """vLLM's: the rotary op of a vLLM model file (`rope_scaling` in config.json's form: its `rope_type` or
    `type`, and that type's parameters, among SUPPORTED_ROPE_TYPES)."""
    params: dict[str, Any] = dict(rope_scaling or {})
    params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
    params.update(rope_theta=float(base), is_neox_style=bool(is_neox_style),
                  partial_rotary_factor=rotary_dim * partial_rotary_factor / head_size)
    params.setdefault("max_position_embeddings", max_position)
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"get_rope: rope type {params['rope_type']!r} is none of {', '.join(SUPPORTED_ROPE_TYPES)}")
    return RotaryEmbedding(head_size, max_position, params)


def rotary_native(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's rotate_half: each pair (even, odd) -> (-odd, even)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotary_interleaved_native(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-J's (interleaved) rotation, `cos`/`sin` holding each angle twice side by side (GLM's layout)."""
    return query * cos + _rotate_pairs(query) * sin, key * cos + _rotate_pairs(key) * sin
