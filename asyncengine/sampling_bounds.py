"""The bounds of every sampling value, defined once: `Annotated` types with `msgspec.Meta` constraints.

Three places declare their sampling fields with these types: the HTTP request Structs
(server/protocol.py), `SamplingParams` (the Python API) and the wire's `SamplingOptions`. A value is
checked where it enters: by msgspec when the server decodes a request body, by `SamplingParams` when it
is built or assigned. Both word a value past a bound with `bound_message`, so the server and the Python
API refuse the same value with the same message. The engine core and its workers trust the wire: what
reaches them was checked by the frontend (docs/sampling.md, "Limits").

Bounds of two kinds:
- fixed ones, where the engine's types set them: integers travel as int64 (torch.long in the workers'
  tensors), floats as float32; and the ranges that give a value its meaning (top_p in (0, 1], ...);
- ones the configuration sets (`n` at most --max-n, token ids within the vocabulary, `max_tokens` within
  the context), declared with `limit(name, ...)`: a Meta whose `le` is the int64 maximum until the
  server specializes it (server/request_bounds.py's `bounded`) or the InputProcessor checks the value
  against the engine's own figure (`SamplingParams.check_limits`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: the least repetition_penalty to divide by

# -- the configuration's limits ------------------------------------------------------------------------

LIMIT_KEY = "asyncengine_limit"  # in Meta.extra: the name of the limit that gives `le`

# What each limit is, for the schema's description and the message a value past it gets.
REASONS = {
    "max_n": "the server's --max-n",
    "max_logprobs": "the server's --max-logprobs (and the vocabulary size)",
    "max_model_len": "the model's maximum context length, which the prompt's tokens share",
    "max_token_id": "the last token id of the model's vocabulary; a larger one is outside the vocabulary",
}


@dataclass(frozen=True)
class RequestBounds:
    """The configuration's limits (each field a limit's name): the server puts them into its request Structs
    (server/request_bounds.py), the InputProcessor checks the Python API's SamplingParams against them."""

    max_n: int
    max_logprobs: int
    max_model_len: int
    max_token_id: int | None  # vocab_size - 1; None when the model's config does not say

    @classmethod
    def of(cls, engine_config: Any, model_config: Any) -> RequestBounds:
        """The limits of an engine's EngineConfig and ModelConfig (Any here: config.model imports
        sampling_params, which imports this module, so naming them would be an import cycle)."""
        vocab = int(getattr(model_config, "vocab_size", 0) or 0)
        max_logprobs = engine_config.max_logprobs
        return cls(max_n=engine_config.max_n, max_logprobs=min(max_logprobs, vocab) if vocab else max_logprobs,
                   max_model_len=model_config.max_model_len, max_token_id=vocab - 1 if vocab > 0 else None)


def limit(name: str, **meta: Any) -> msgspec.Meta:
    """A Meta whose `le` is the configuration's limit `name` (until it is known, the int64 maximum)."""
    if name not in REASONS:
        raise ValueError(f"unknown limit {name!r}: one of {sorted(REASONS)}")
    return msgspec.Meta(le=INT64_MAX, extra={LIMIT_KEY: name}, **meta)


# -- the table -----------------------------------------------------------------------------------------

Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]  # seed, priority: as vLLM bounds them
TokenId = Annotated[int, limit("max_token_id", ge=0)]
NumCompletions = Annotated[int, limit("max_n", ge=1)]  # n (and best_of)
NumTokens = Annotated[int, limit("max_model_len", ge=1)]  # max_tokens and the like: the prompt shares the context
MinTokens = Annotated[int, limit("max_model_len", ge=0)]
NumLogprobs = Annotated[int, limit("max_logprobs", ge=0)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=FLOAT32_MAX)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)]  # 0 and -1: off
Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]  # min_p
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]  # presence_penalty, frequency_penalty
# greater than 0: the worker divides by it, in float32
RepetitionPenalty = Annotated[float, msgspec.Meta(ge=FLOAT32_TINY, le=FLOAT32_MAX)]
# keep the prompt's last N tokens; -1: the last max_model_len (0 is refused by SamplingParams)
TruncatePromptTokens = Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]  # a non-negative int64 (a count of tools, ...)
PositiveCount = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
# OpenAI's bounds for a logit bias. vLLM clamps a bias outside them; we refuse it, as OpenAI does.
LogitBias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]

# -- how a value past a bound is said ------------------------------------------------------------------

RANGE_WORDS = {">=": "at least", "<=": "at most", ">": "greater than", "<": "less than"}


def bound_message(param: str, op: str, bound: str, found: tuple[str, int] | None = None) -> str:
    """`param` past the bound `op bound` ("<=", "1.0"), in words; `found`: the configuration's limit that
    sets this bound (its name and value), said with what it is. The server's 400s and SamplingParams'
    RequestErrors both come from here."""
    text = f"{param} must be {RANGE_WORDS[op]} {bound}"
    if found is not None and op == "<=" and str(found[1]) == bound:
        text += f" ({found[0]}={found[1]}: {REASONS[found[0]]})"
    return text


# msgspec's words for a value it refused: "Expected `int` <= 5 - at `$.n`"; "$.stop[1]"; "$.logit_bias[...]"
# (a dict's value: the dict names the field).
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_RANGE = re.compile(r"^Expected `[^`]*` (>=|<=|>|<) (\S+)$")
_LENGTH = re.compile(r"^Expected `(str|array|object)` of length (>=|<=) (\d+)$")
_LENGTH_UNITS = {"str": "characters", "array": "items", "object": "entries"}


def split_validation_error(text: str) -> tuple[str, bool, str]:
    """msgspec's ValidationError text as (the path of the value without `$.`, whether that value is one of
    a dict's values, msgspec's message without the path)."""
    match = _PATH.search(text)
    path = match.group(1) if match else ""
    return path.replace("[...]", ""), path.endswith("[...]"), _PATH.sub("", text)


def top_level(param: str) -> str:
    """"stop_token_ids[1]" -> "stop_token_ids": the field a nested value belongs to."""
    return re.split(r"[.\[]", param, maxsplit=1)[0]


def is_bound(message: str) -> bool:
    """Whether msgspec's `message` says a value is past a declared bound (a range or a length)."""
    return bool(_RANGE.match(message) or _LENGTH.match(message))


def invalid_value_message(param: str, message: str, *, in_dict: bool = False,
                          found: tuple[str, int] | None = None) -> str:
    """The words for msgspec's `message` about the value at `param`: a bound said in words (with the
    configuration's limit `found` when one sets it), anything else as msgspec says it, naming the field."""
    if not param:
        return f"invalid request body: {message}"
    length = _LENGTH.match(message)
    if length:
        kind, op, value = length.groups()
        unit = _LENGTH_UNITS[kind] if value != "1" else _LENGTH_UNITS[kind][:-1]
        text = f"{param} must hold {RANGE_WORDS[op]} {value} {unit}"
    elif (bound := _RANGE.match(message)) is not None:
        text = bound_message(param, bound.group(1), bound.group(2), found)
    else:
        return f"invalid value for {param!r}: {message}"
    return f"each value of {text}" if in_dict else text
