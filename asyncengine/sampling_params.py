"""SamplingParams: how to sample one request, with vLLM's names and defaults.

The class remembers which fields the caller set. A model's generation_config.json supplies defaults
for the fields the request left alone (`with_defaults`), as docs/architecture.md promises. Every check
raises `RequestError` naming the field, so the HTTP layer can answer 400 with `param` filled in.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from asyncengine.errors import RequestError
from asyncengine.structured_output_spec import StructuredOutputsParams

_GREEDY_EPSILON = 1e-5

# The engine's types (docs/sampling.md, "Limits"): integers travel as int64 (torch.long in the
# worker's tensors), floats are float32 there. Every value is checked against them here, so nothing
# a request sets can overflow a tensor in a worker. Tighter, meaningful bounds (the vocabulary, the
# context, --max-n) need the model and the engine, and are checked by the frontend's InputProcessor.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38

# vLLM's defaults. Order is the constructor's keyword order.
_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop": None,
    "stop_token_ids": None,
    "ignore_eos": False,
    "max_tokens": 16,
    "min_tokens": 0,
    "logprobs": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "extra_args": None,
    "structured_outputs": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "truncate_prompt_tokens": None,
}

# Fields that a model's generation_config.json may supply, with the name it uses there.
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_new_tokens",
}

_UNSET: Any = object()


class SamplingParams:
    """Sampling options for one request. `temperature=0` is greedy; `top_k=0` (or -1) is off."""

    __slots__ = (*_DEFAULTS, "_explicit")

    # The fields as the checks leave them (the slots above hold them; annotations alone add no class attribute).
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    max_tokens: int | None
    min_tokens: int
    logprobs: int | None
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    include_stop_str_in_output: bool
    extra_args: dict[str, Any] | None
    structured_outputs: StructuredOutputsParams | None
    logit_bias: dict[int, float] | None
    allowed_token_ids: list[int] | None
    bad_words: list[str] | None
    truncate_prompt_tokens: int | None  # keep the prompt's last N tokens; -1: up to max_model_len (vLLM's)
    _explicit: frozenset[str]

    def __init__(
        self,
        *,
        n: int = _UNSET,
        temperature: float = _UNSET,
        top_p: float = _UNSET,
        top_k: int = _UNSET,
        min_p: float = _UNSET,
        seed: int | None = _UNSET,
        presence_penalty: float = _UNSET,
        frequency_penalty: float = _UNSET,
        repetition_penalty: float = _UNSET,
        stop: str | list[str] | None = _UNSET,
        stop_token_ids: list[int] | None = _UNSET,
        ignore_eos: bool = _UNSET,
        max_tokens: int | None = _UNSET,
        min_tokens: int = _UNSET,
        logprobs: int | None = _UNSET,
        skip_special_tokens: bool = _UNSET,
        spaces_between_special_tokens: bool = _UNSET,
        include_stop_str_in_output: bool = _UNSET,
        extra_args: dict[str, Any] | None = _UNSET,
        structured_outputs: StructuredOutputsParams | None = _UNSET,
        logit_bias: dict[int, float] | dict[str, float] | None = _UNSET,
        allowed_token_ids: list[int] | None = _UNSET,
        bad_words: list[str] | None = _UNSET,
        truncate_prompt_tokens: int | None = _UNSET,
    ) -> None:
        given = dict(locals())
        explicit = set()
        for name, default in _DEFAULTS.items():
            value = given[name]
            if value is _UNSET:
                value = default
            else:
                explicit.add(name)
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_explicit", frozenset(explicit))
        self._normalize_and_check()

    # -- validation ------------------------------------------------------------------------------------

    def _normalize_and_check(self) -> None:
        _check_int(self.n, "n", minimum=1)
        _check_number(self.temperature, "temperature", minimum=0.0)
        _check_number(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        # top_k above the vocabulary keeps every token (the InputProcessor turns it off); past int64
        # it could not reach a worker's tensors at all.
        _check_int(self.top_k, "top_k", minimum=-1)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check_number(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}", field="min_p")
        if self.seed is not None:
            _check_int(self.seed, "seed", minimum=INT64_MIN)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(value, name)
            if not -2.0 <= value <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {value}", field=name)
        _check_number(self.repetition_penalty, "repetition_penalty")
        if not self.repetition_penalty >= _FLOAT32_TINY:
            raise RequestError(
                f"repetition_penalty must be greater than 0 (at least {_FLOAT32_TINY:.3g}, the smallest float32 "
                f"the worker can divide by), got {self.repetition_penalty}",
                field="repetition_penalty",
            )
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", [])
        else:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise RequestError("stop_token_ids must be a list of token ids", field="stop_token_ids")
            for token_id in self.stop_token_ids:
                _check_int(token_id, "stop_token_ids", minimum=0)
            object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false", field=name)
        if self.max_tokens is not None:
            _check_int(self.max_tokens, "max_tokens", minimum=1)
        _check_int(self.min_tokens, "min_tokens", minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                field="min_tokens",
            )
        if self.logprobs is not None:
            _check_int(self.logprobs, "logprobs", minimum=0)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            _check_int(self.truncate_prompt_tokens, "truncate_prompt_tokens", minimum=1)
        object.__setattr__(self, "extra_args", _normalize_extra_args(self.extra_args))
        object.__setattr__(self, "structured_outputs", _normalize_structured_outputs(self.structured_outputs))
        object.__setattr__(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        object.__setattr__(self, "allowed_token_ids", _normalize_allowed_token_ids(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", _normalize_bad_words(self.bad_words))

    # -- derived views -----------------------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def explicit_fields(self) -> frozenset[str]:
        """The fields the caller set (the others may take the model's generation_config defaults)."""
        return self._explicit

    def with_defaults(self, defaults: dict[str, Any]) -> "SamplingParams":
        """A copy where each field the caller did not set takes `defaults[field]` when present."""
        values = {name: getattr(self, name) for name in self._explicit}
        filled = {name: value for name, value in defaults.items() if name not in self._explicit and name in _DEFAULTS}
        values.update(filled)
        try:
            merged = SamplingParams(**values)
        except RequestError as exc:
            if exc.field in filled and exc.field not in self._explicit and len(filled) == 1:
                message = f"the model's generation_config.json gives an invalid default: {exc.message}"
            else:
                message = (
                    f"with the model's generation_config.json defaults ({', '.join(sorted(filled))}) "
                    f"the request is invalid: {exc.message}"
                )
            raise RequestError(message, field=exc.field) from exc
        # Defaults filled in are not "explicit": keep the caller's view of what they set.
        object.__setattr__(merged, "_explicit", self._explicit)
        return merged

    def clone(self, **changes: Any) -> "SamplingParams":
        """A copy with `changes` applied (and checked); the changed fields count as set by the caller."""
        values = {name: getattr(self, name) for name in _DEFAULTS}
        values.update(changes)
        return _rebuild(values, self._explicit | frozenset(changes))

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any], frozenset[str]]]:
        # copy.copy / copy.deepcopy: rebuild through the constructor (slots plus a validating
        # __setattr__ cannot be restored attribute by attribute).
        return _rebuild, ({name: getattr(self, name) for name in _DEFAULTS}, self._explicit)

    def __setattr__(self, name: str, value: Any) -> None:
        # Assignment goes through the same checks as the constructor.
        if name not in _DEFAULTS:
            raise AttributeError(f"SamplingParams has no field {name!r}")
        replaced = self.clone(**{name: value})
        for field in _DEFAULTS:
            object.__setattr__(self, field, getattr(replaced, field))
        object.__setattr__(self, "_explicit", replaced._explicit)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplingParams):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _DEFAULTS)

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in _DEFAULTS)
        return f"SamplingParams({fields})"


def _rebuild(values: dict[str, Any], explicit: frozenset[str]) -> SamplingParams:
    params = SamplingParams(**values)
    object.__setattr__(params, "_explicit", frozenset(explicit))
    return params


_FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


def _check_int(value: Any, field: str, *, minimum: int) -> None:
    """An integer in [minimum, INT64_MAX]: every integer field travels as an int64."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{field} must be an integer, got {value!r}", field=field)
    if value < minimum:
        raise RequestError(f"{field} must be at least {minimum}, got {value}", field=field)
    if value > INT64_MAX:
        raise RequestError(f"{field} must be at most {INT64_MAX} (2^63 - 1, the engine's int64), got {value}",
                           field=field)


def _check_number(value: Any, field: str, *, minimum: float | None = None) -> None:
    """A finite number that stays finite as a float32 (the workers' tensors)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{field} must be a finite number, got {value!r}", field=field)
    try:
        finite = math.isfinite(value) and abs(value) <= FLOAT32_MAX
    except OverflowError:  # an int too large to compare as a float
        finite = False
    if not finite:
        raise RequestError(f"{field} must be a finite number of magnitude at most {FLOAT32_MAX:.4g} (float32), "
                           f"got {value!r}", field=field)
    if minimum is not None and value < minimum:
        raise RequestError(f"{field} must be at least {minimum}, got {value}", field=field)


def _normalize_extra_args(extra_args: Any) -> dict[str, Any] | None:
    """extra_args as the worker will see it: it crosses processes as msgpack, so it must encode, and
    keeping the decoded copy means validate_params in the frontend and the processors in the worker
    see the same values (a tuple becomes a list in both)."""
    if extra_args is None:
        return None
    if not isinstance(extra_args, dict) or not all(isinstance(key, str) for key in extra_args):
        raise RequestError("extra_args must be a dict with string keys, or None", field="extra_args")
    try:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(extra_args), type=dict[str, Any])
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.MsgspecError) as exc:
        raise RequestError(
            f"extra_args must hold only msgpack-encodable values (dicts, lists, strings, numbers, booleans, "
            f"None): {exc}",
            field="extra_args",
        ) from exc


def _normalize_structured_outputs(value: Any) -> StructuredOutputsParams | None:
    """A StructuredOutputsParams (a dict of its fields is taken too), checked to name one constraint."""
    if value is None:
        return None
    if isinstance(value, dict):
        try:
            value = StructuredOutputsParams(**value)
        except TypeError as exc:
            raise RequestError(f"structured_outputs: {exc}", field="structured_outputs") from exc
    if not isinstance(value, StructuredOutputsParams):
        raise RequestError(f"structured_outputs must be a StructuredOutputsParams, got {type(value).__name__}",
                           field="structured_outputs")
    value.to_spec()  # exactly one constraint, each of the right type
    return value


# OpenAI's bounds for a logit bias. vLLM clamps a bias outside them; we refuse it, as OpenAI does.
LOGIT_BIAS_MAX = 100.0


def _normalize_logit_bias(value: Any) -> dict[int, float] | None:
    """{token id: bias}: keys are ints, or strings of ints (JSON's object keys, as OpenAI sends them);
    each bias a number in [-100, 100]. The vocabulary bound is the InputProcessor's (it knows the model)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(f"logit_bias must be an object mapping token ids to biases, got {type(value).__name__}",
                           field="logit_bias")
    biases: dict[int, float] = {}
    for key, bias in value.items():
        token_id = _token_id_key(key)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
            raise RequestError(f"logit_bias[{key}] must be a number in [-100, 100], got {bias!r}",
                               field="logit_bias")
        if token_id in biases:
            raise RequestError(f"logit_bias names token id {token_id} twice (as {key!r})", field="logit_bias")
        biases[token_id] = float(bias)
    return biases or None


def _token_id_key(key: Any) -> int:
    if isinstance(key, str) and key.isascii() and key.isdigit():
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key <= INT64_MAX:
        raise RequestError(f"logit_bias keys must be token ids (non-negative integers; strings of digits in JSON), "
                           f"got {key!r}", field="logit_bias")
    return key


def _normalize_allowed_token_ids(value: Any) -> list[int] | None:
    """A non-empty list of token ids (vLLM refuses an empty one too: nothing could be sampled)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise RequestError("allowed_token_ids must be a list of token ids", field="allowed_token_ids")
    if not value:
        raise RequestError("allowed_token_ids must not be empty: no token could be sampled (leave it unset to "
                           "allow every token)", field="allowed_token_ids")
    for token_id in value:
        _check_int(token_id, "allowed_token_ids", minimum=0)
    return list(dict.fromkeys(value))


def _normalize_bad_words(value: Any) -> list[str] | None:
    """Words that must not be generated (tokenized by the InputProcessor). A word of whitespace only
    is refused: vLLM strips leading whitespace before tokenizing, which would leave nothing to ban."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(word, str) for word in value):
        raise RequestError("bad_words must be a list of strings", field="bad_words")
    for word in value:
        if not word.strip():
            raise RequestError(f"bad_words holds {word!r}: each bad word needs a character other than whitespace",
                               field="bad_words")
    return list(value) or None


def _normalize_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a string or a list of strings", field="stop")
    if any(s == "" for s in stop):
        raise RequestError("stop strings must be non-empty", field="stop")
    return list(stop)
