"""SamplingParams: how to sample one request, with vLLM's names and defaults, as a msgspec Struct.

Every field is typed with the bounds table (sampling_bounds.py), which the server's request Structs
and the wire's SamplingOptions share: a value is checked when the object is built (whichever way: the
constructor, `msgspec.convert`, a decoder) and when a field is assigned, and a value past a bound gets
the words the server's 400 has. The class remembers which fields the caller set (`explicit_fields`): a
model's generation_config.json supplies defaults for the fields the request left alone (`with_defaults`),
as docs/architecture.md promises. Every check raises `RequestError` naming the field, so the HTTP layer
can answer 400 with `param` filled in. The bounds that need the engine's configuration (n, logprobs,
token ids) are checked by the InputProcessor with `check_limits`, in the same words.
"""

from __future__ import annotations

import copy
import functools
import typing
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from asyncengine.errors import RequestError
from asyncengine.sampling_bounds import (
    LIMIT_KEY, INT64_MAX, LogitBias, MinTokens, NumCompletions, NumLogprobs, NumTokens, Penalty, Probability,
    RepetitionPenalty, Temperature, TokenId, TopK, TopP, TruncatePromptTokens, Int64, bound_message,
    invalid_value_message, split_validation_error, top_level,
)
from asyncengine.structured_output_spec import StructuredOutputsParams

_GREEDY_EPSILON = 1e-5

# Fields that a model's generation_config.json may supply, with the name it uses there.
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_new_tokens",
}


class _RecordsExplicitFields(msgspec.StructMeta):
    """SamplingParams' metaclass: a call records the keywords it was given as the fields the caller set
    (a msgspec Struct cannot define __init__; `__post_init__` has checked them by then)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        params = super().__call__(*args, **kwargs)
        params.__dict__["_explicit"] = frozenset(kwargs)
        return params


class SamplingParams(msgspec.Struct, kw_only=True, dict=True, metaclass=_RecordsExplicitFields):
    """Sampling options for one request. `temperature=0` is greedy; `top_k=0` (or -1) is off.

    Some fields take other forms and are normalized: `stop` a string, `stop_token_ids` None or a tuple,
    `logit_bias` string keys (JSON's), `bad_words` a string, `structured_outputs` a dict of its fields."""

    n: NumCompletions = 1
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: Probability = 0.0
    seed: Int64 | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[TokenId] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: NumTokens | None = 16
    min_tokens: MinTokens = 0
    logprobs: NumLogprobs | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[TokenId, LogitBias] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # keep the prompt's last N; -1: max_model_len

    # -- validation ------------------------------------------------------------------------------------

    def __post_init__(self) -> None:
        set_field = msgspec.Struct.__setattr__  # (this class's __setattr__ checks through a new instance)
        set_field(self, "stop", _normalize_stop(self.stop))
        if self.stop_token_ids is None:
            set_field(self, "stop_token_ids", [])
        elif not isinstance(self.stop_token_ids, (list, tuple)):
            raise RequestError("stop_token_ids must be a list of token ids", field="stop_token_ids")
        set_field(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, (list, tuple)):
            raise RequestError("allowed_token_ids must be a list of token ids", field="allowed_token_ids")
        # The bounds table, through msgspec: the same checks and words as the server's.
        try:
            checked: Any = msgspec.convert({name: getattr(self, name) for name in _CHECKED_FIELDS}, _checked_struct())
        except msgspec.ValidationError as exc:
            param, in_dict, message = split_validation_error(str(exc))
            raise RequestError(invalid_value_message(param, message, in_dict=in_dict),
                               field=top_level(param)) from None
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):  # copies: lists, float biases
            set_field(self, name, getattr(checked, name))
        if self.top_k == -1:
            set_field(self, "top_k", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                field="min_tokens",
            )
        if self.truncate_prompt_tokens == 0:
            raise RequestError("truncate_prompt_tokens must be at least 1 (or -1: the last max_model_len tokens)",
                               field="truncate_prompt_tokens")
        set_field(self, "extra_args", _normalize_extra_args(self.extra_args))
        set_field(self, "structured_outputs", _normalize_structured_outputs(self.structured_outputs))
        set_field(self, "allowed_token_ids", _normalize_allowed_token_ids(self.allowed_token_ids))
        set_field(self, "bad_words", _normalize_bad_words(self.bad_words))

    # -- derived views -----------------------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def explicit_fields(self) -> frozenset[str]:
        """The fields the caller set (the others may take the model's generation_config defaults). An
        object decoded rather than called counts the fields that differ from their defaults."""
        explicit = self.__dict__.get("_explicit")
        if explicit is None:
            default = SamplingParams()
            explicit = frozenset(name for name in self.__struct_fields__
                                 if getattr(self, name) != getattr(default, name))
        return explicit

    def with_defaults(self, defaults: dict[str, Any]) -> SamplingParams:
        """A copy where each field the caller did not set takes `defaults[field]` when present."""
        explicit = self.explicit_fields
        values = {name: getattr(self, name) for name in explicit}
        filled = {name: value for name, value in defaults.items()
                  if name not in explicit and name in self.__struct_fields__}
        values.update(filled)
        try:
            merged = SamplingParams(**values)
        except RequestError as exc:
            if exc.field in filled and exc.field not in explicit and len(filled) == 1:
                message = f"the model's generation_config.json gives an invalid default: {exc.message}"
            else:
                message = (
                    f"with the model's generation_config.json defaults ({', '.join(sorted(filled))}) "
                    f"the request is invalid: {exc.message}"
                )
            raise RequestError(message, field=exc.field) from exc
        # Defaults filled in are not "explicit": keep the caller's view of what they set.
        merged.__dict__["_explicit"] = explicit
        return merged

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied (and checked); the changed fields count as set by the caller."""
        values = {name: getattr(self, name) for name in self.__struct_fields__}
        values.update(changes)
        return _rebuild(values, self.explicit_fields | frozenset(changes))

    # copy, deepcopy and pickle keep what the caller set (msgspec's own would call the class with every field).
    def __copy__(self) -> SamplingParams:
        return self.clone()

    def __deepcopy__(self, memo: dict[int, Any]) -> SamplingParams:
        values = copy.deepcopy({name: getattr(self, name) for name in self.__struct_fields__}, memo)
        return _rebuild(values, self.explicit_fields)

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any], frozenset[str]]]:
        return _rebuild, ({name: getattr(self, name) for name in self.__struct_fields__}, self.explicit_fields)

    def __setattr__(self, name: str, value: Any) -> None:
        # Assignment goes through the same checks as the constructor, and leaves the object as it was
        # when they fail.
        if name not in self.__struct_fields__:
            raise AttributeError(f"SamplingParams has no field {name!r}")
        replaced = self.clone(**{name: value})
        for field in self.__struct_fields__:
            msgspec.Struct.__setattr__(self, field, getattr(replaced, field))
        self.__dict__["_explicit"] = replaced.explicit_fields


def _rebuild(values: dict[str, Any], explicit: frozenset[str]) -> SamplingParams:
    params = SamplingParams(**values)
    params.__dict__["_explicit"] = explicit
    return params


# The fields whose bounds and types the table's msgspec types check (the others have shapes of their own,
# normalized by hand below). `logit_bias` is checked after its keys became ints.
_CHECKED_FIELDS = tuple(name for name in SamplingParams.__struct_fields__
                        if name not in ("stop", "extra_args", "structured_outputs", "bad_words"))


@functools.cache
def _checked_struct() -> type:
    """A Struct of SamplingParams' checked fields, with their types (the table's) and no __post_init__."""
    types = typing.get_type_hints(SamplingParams, include_extras=True)
    return msgspec.defstruct("SamplingParams", [(name, types[name]) for name in _CHECKED_FIELDS], kw_only=True)


def check_limits(params: SamplingParams, limits: Mapping[str, int | None]) -> None:
    """Check `params` against the configuration's limits (`limits[name]` for each `limit(name)` of the table
    that a field carries; a name absent or None is not checked), in the words of the server's 400s. The
    InputProcessor passes the limits that do not concern the context: those it checks with the prompt."""
    for name, limit_name, shape in _limited_fields():
        value, bound = getattr(params, name), limits.get(limit_name)
        if value is None or bound is None:
            continue
        if shape == "scalar" and value > bound:
            raise RequestError(bound_message(name, "<=", str(bound), (limit_name, bound)), field=name)
        if shape == "items":
            for index, item in enumerate(value):
                if item > bound:
                    raise RequestError(bound_message(f"{name}[{index}]", "<=", str(bound), (limit_name, bound)),
                                       field=name)
        if shape == "keys":
            for key in value:
                if key > bound:
                    # (a key has no path of its own: the message names it)
                    raise RequestError(f"{name} has token id {key}, outside the vocabulary (0..{bound})"
                                       if limit_name == "max_token_id" else
                                       bound_message(f"{name} key {key}", "<=", str(bound), (limit_name, bound)),
                                       field=name)


@functools.cache
def _limited_fields() -> tuple[tuple[str, str, str], ...]:
    """(field, limit name, "scalar" | "items" | "keys") for each SamplingParams field the table limits."""
    found = []
    for name, tp in typing.get_type_hints(SamplingParams, include_extras=True).items():
        for shape, inner in _shapes(tp):
            limit_name = _limit_name(inner)
            if limit_name is not None:
                found.append((name, limit_name, shape))
    return tuple(found)


def _shapes(tp: Any) -> list[tuple[str, Any]]:
    """The Annotated types a field's type holds: itself, a list's items, a dict's keys (through `| None`)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return [("scalar", tp)]
    if origin is list:
        return [("items", args[0])]
    if origin is dict:
        return [("keys", args[0])]
    return [shape for arg in args for shape in _shapes(arg)]  # a union


def _limit_name(tp: Any) -> str | None:
    if typing.get_origin(tp) is not Annotated:
        return None
    for meta in typing.get_args(tp)[1:]:
        if isinstance(meta, msgspec.Meta) and meta.extra and LIMIT_KEY in meta.extra:
            return str(meta.extra[LIMIT_KEY])
    return None


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


def _normalize_logit_bias(value: Any) -> dict[Any, Any] | None:
    """{token id: bias}: keys are ints, or strings of ints (JSON's object keys, as OpenAI sends them). The
    biases are checked with the table (LogitBias, [-100, 100]); the vocabulary bound is the InputProcessor's."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(f"logit_bias must be an object mapping token ids to biases, got {type(value).__name__}",
                           field="logit_bias")
    biases: dict[int, Any] = {}
    for key, bias in value.items():
        token_id = _token_id_key(key)
        if token_id in biases:
            raise RequestError(f"logit_bias names token id {token_id} twice (as {key!r})", field="logit_bias")
        biases[token_id] = bias
    return biases or None  # an empty bias changes nothing


def _token_id_key(key: Any) -> int:
    if isinstance(key, str) and key.isascii() and key.isdigit():
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key <= INT64_MAX:
        raise RequestError(f"logit_bias keys must be token ids (non-negative integers; strings of digits in JSON), "
                           f"got {key!r}", field="logit_bias")
    return key


def _normalize_allowed_token_ids(value: list[int] | None) -> list[int] | None:
    """A non-empty list of token ids (vLLM refuses an empty one too: nothing could be sampled), each once."""
    if value is None:
        return None
    if not value:
        raise RequestError("allowed_token_ids must not be empty: no token could be sampled (leave it unset to "
                           "allow every token)", field="allowed_token_ids")
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
