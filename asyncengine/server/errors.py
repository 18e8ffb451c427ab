"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with the HTTP status.

Every way a request can go wrong maps here: a body msgspec rejects (400, with the path of the bad
field), an engine RequestError (400, with its field), an unknown model (400), a body over the limit
(413), a missing or wrong API key (401), a saturated engine (503 with Retry-After), a dead engine (503).
"""

from __future__ import annotations

import re

import msgspec

from asyncengine.errors import EngineDeadError, EngineOverloadedError, RequestError
from asyncengine.server.protocol import too_deep_field
from asyncengine.server.request_bounds import REASONS, field_limit

RETRY_AFTER_SECONDS = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        return msgspec.json.encode(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        )


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def too_deep(body: bytes) -> ApiError:
    """A 400 for a body msgspec raised RecursionError on (JSON nested deeper than it decodes), naming the
    top-level field that holds the nesting."""
    param = too_deep_field(body)
    return bad_request(f"{param or 'the request body'} nests JSON arrays or objects too deeply: flatten it",
                       param=param, code="invalid_value")


# "Expected `int`, got `str` - at `$.max_tokens`" -> "max_tokens"; "$.messages[0].role" -> "messages[0].role"
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]*)`")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`")
# A bound declared on a field (msgspec.Meta): "Expected `int` >= 1", "Expected `array` of length <= 8".
_RANGE = re.compile(r"^Expected `[^`]*` (>=|<=|>|<) (\S+)$")
_LENGTH = re.compile(r"^Expected `(str|array|object)` of length (>=|<=) (\d+)$")
_RANGE_WORDS = {">=": "at least", "<=": "at most", ">": "greater than", "<": "less than"}
_LENGTH_UNITS = {"str": "characters", "array": "items", "object": "entries"}


def from_validation_error(error: msgspec.ValidationError | msgspec.DecodeError,
                          struct: type | None = None) -> ApiError:
    """A body msgspec could not decode or validate, as a 400 naming the field. A value past a bound is said
    in words, with what sets the bound when the server's configuration does (`struct`: the decoded type)."""
    text = str(error)
    if isinstance(error, msgspec.DecodeError) and not isinstance(error, msgspec.ValidationError):
        return bad_request(f"the request body is not valid JSON: {text}", code="invalid_json")
    match = _PATH.search(text)
    in_dict = bool(match) and match.group(1).endswith("[...]")  # type: ignore[union-attr]
    parent = match.group(1).replace("[...]", "") if match else ""  # a dict's value: the dict names the field
    missing = _MISSING.match(text)
    if missing:
        param = f"{parent}.{missing.group(1)}" if parent else missing.group(1)
        return bad_request(f"missing required parameter {param!r}", param=param, code="missing_parameter")
    unknown = _UNKNOWN.match(text)
    if unknown:
        param = f"{parent}.{unknown.group(1)}" if parent else unknown.group(1)
        return bad_request(f"unsupported parameter {param!r}: this server does not know it", param=param,
                           code="unsupported_parameter")
    message = _PATH.sub("", text)
    if parent and (_RANGE.match(message) or _LENGTH.match(message)):
        text = _bound_message(parent, message, struct)
        return bad_request(f"each value of {text}" if in_dict else text, param=parent, code="invalid_value")
    return bad_request(f"invalid value for {parent or 'the body'!r}: {message}" if parent else
                       f"invalid request body: {message}", param=parent or None, code="invalid_value")


def _bound_message(param: str, message: str, struct: type | None) -> str:
    length = _LENGTH.match(message)
    if length:
        kind, op, value = length.groups()
        unit = _LENGTH_UNITS[kind] if value != "1" else _LENGTH_UNITS[kind][:-1]
        return f"{param} must hold {_RANGE_WORDS[op]} {value} {unit}"
    op, value = _RANGE.match(message).groups()  # type: ignore[union-attr]  # (the caller matched one of the two)
    text = f"{param} must be {_RANGE_WORDS[op]} {value}"
    top_level = re.split(r"[.\[]", param, maxsplit=1)[0]
    found = field_limit(struct, top_level) if struct is not None and op == "<=" else None
    if found is not None and str(found[1]) == value:
        text += f" ({found[0]}={found[1]}: {REASONS[found[0]]})"
    return text


def http_param(field: str | None) -> str | None:
    """The request parameter an engine field came from: SamplingParams.extra_args arrives over HTTP as
    `vllm_xargs` (vLLM's name), so `extra_args.banned_token_ids` is `vllm_xargs.banned_token_ids`."""
    if field is not None and (field == "extra_args" or field.startswith(("extra_args.", "extra_args["))):
        return "vllm_xargs" + field[len("extra_args"):]
    return field


def from_engine_error(error: BaseException) -> ApiError:
    """Engine errors a request can meet, as HTTP errors."""
    if isinstance(error, RequestError):
        param = http_param(error.field)
        message = error.message
        if param != error.field and message.startswith("extra_args "):  # the engine's name for it, in its words
            message = "vllm_xargs" + message[len("extra_args"):]
        if error.source:  # a plugin refused the request: say which one, and which parameter
            message = f"{error.source} refused {param or 'the request'}: {message}"
        return bad_request(message, param=param, code=error.code or "invalid_value")
    if isinstance(error, EngineOverloadedError):
        return ApiError(503, str(error), type="service_unavailable", code="engine_overloaded",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(error, EngineDeadError):
        return ApiError(503, f"the engine is not running: {error}", type="service_unavailable", code="engine_dead")
    raise TypeError(f"not an engine error: {error!r}")  # a bug here, not a request problem
