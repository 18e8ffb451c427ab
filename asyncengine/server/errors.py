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
from asyncengine.sampling_bounds import invalid_value_message, is_bound, split_validation_error, top_level
from asyncengine.server.request_bounds import field_limit

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


# msgspec's words for a body it refused: "Object missing required field `model` - at `$.messages[0]`".
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]*)`")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`")


def from_validation_error(error: msgspec.ValidationError | msgspec.DecodeError,
                          struct: type | None = None) -> ApiError:
    """A body msgspec could not decode or validate, as a 400 naming the field. A value past a bound is said
    in words (sampling_bounds.py: the Python API's SamplingParams says it in the same words), with what sets
    the bound when the server's configuration does (`struct`: the decoded type)."""
    text = str(error)
    if isinstance(error, msgspec.DecodeError) and not isinstance(error, msgspec.ValidationError):
        return bad_request(f"the request body is not valid JSON: {text}", code="invalid_json")
    parent, in_dict, message = split_validation_error(text)
    missing = _MISSING.match(message)
    if missing:
        param = f"{parent}.{missing.group(1)}" if parent else missing.group(1)
        return bad_request(f"missing required parameter {param!r}", param=param, code="missing_parameter")
    unknown = _UNKNOWN.match(message)
    if unknown:
        param = f"{parent}.{unknown.group(1)}" if parent else unknown.group(1)
        return bad_request(f"unsupported parameter {param!r}: this server does not know it", param=param,
                           code="unsupported_parameter")
    found = field_limit(struct, top_level(parent)) if struct is not None and parent and is_bound(message) else None
    return bad_request(invalid_value_message(parent, message, in_dict=in_dict, found=found), param=parent or None,
                       code="invalid_value")


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
