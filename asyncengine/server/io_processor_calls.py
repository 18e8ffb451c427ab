"""One request's calls into the chosen IO processor, in vLLM's order (interfaces/io_processor.py): parse,
pre_process, merge the parameters, post_process, the response; and the response's `data` as JSON.

The calls of one request share one contextvars context (a plugin may set a ContextVar in pre_process and read
it in merge_pooling_params, as vLLM's single thread lets it), each plain method in a worker thread, each
`async def` on the event loop. `request_id` is passed to pre_process and post_process where their signature
takes it (or `**kwargs`). What the plugin raises answers that request only: `RequestError` or `ValueError` is
a 400 (it refused the input), anything else a 500 logged with its traceback; both name the plugin (its
entry point, class and distribution) and the method.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
from functools import partial
from typing import Any

import anyio
import msgspec

from asyncengine.interfaces.io_processor import IOProcessor, IOProcessorResponse
from asyncengine.interfaces.plugin_code import describe_owner
from asyncengine.server.errors import ApiError, bad_request

logger = logging.getLogger("asyncengine.server")


def overrides(processor: Any, method: str) -> bool:
    """Whether the plugin's class defines `method` itself (rather than our base's default)."""
    own = getattr(type(processor), method, None)
    return own is not None and own is not getattr(IOProcessor, method, None)


def _takes(function: Any, name: str) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


def plugin_error(name: str | None, processor: Any, method: str, status: int, what: str, *,
                 param: str | None = None) -> ApiError:
    owner = describe_owner(processor) if processor is not None else "?"
    message = f"IO processor {name!r} ({owner}) {method} {what}"
    if status == 400:
        return bad_request(message, param=param, code="io_processor_refused")
    return ApiError(500, message, type="internal_error", code="io_processor_error")


class RequestCalls:
    """The plugin's calls for one request (`name`: its entry point; `request_id`: the request's id)."""

    def __init__(self, name: str | None, processor: Any, request_id: str) -> None:
        self.name = name
        self.processor = processor
        self.request_id = request_id
        self._context = contextvars.copy_context()

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        function = getattr(self.processor, method)
        try:
            if inspect.iscoroutinefunction(function):
                return await self._context.run(partial(function, *args, **kwargs))
            result = await anyio.to_thread.run_sync(partial(self._context.run, function, *args, **kwargs))
            if inspect.isawaitable(result):  # a plain method that returned a coroutine
                result = await result
            return result
        except ValueError as exc:  # RequestError is one too: the plugin refused this input
            param = getattr(exc, "field", None) or "data"
            raise plugin_error(self.name, self.processor, method, 400,
                               f"refused the request: {type(exc).__name__}: {exc}", param=param) from exc
        except Exception as exc:
            # A bug in the plugin (or input it did not expect): this request fails with a 500 that names it, the
            # traceback goes to the log, and the server keeps serving the others.
            logger.exception("IO processor %r failed in %s", self.name, method)
            raise plugin_error(self.name, self.processor, method, 500,
                               f"failed: {type(exc).__name__}: {exc}") from exc

    async def parse(self, request: Any) -> Any:
        """The plugin's input: parse_data(request.data), or parse_request(request), or the request itself."""
        if overrides(self.processor, "parse_data"):
            return await self.call("parse_data", request.data)
        if overrides(self.processor, "parse_request"):
            return await self.call("parse_request", request)
        return request

    async def pre_process(self, prompt: Any) -> Any:
        method = "pre_process_async" if overrides(self.processor, "pre_process_async") else "pre_process"
        return await self._with_request_id(method, prompt)

    async def post_process(self, outputs: Any) -> Any:
        method = "post_process_async" if overrides(self.processor, "post_process_async") else "post_process"
        if method == "post_process_async":  # vLLM's: the outputs as an async stream of (index, output)
            return await self._with_request_id(method, _indexed(outputs))
        return await self._with_request_id(method, outputs)

    async def merge_params(self, params: Any, kind: str) -> Any:
        """`kind` "pooling" or "sampling": the plugin's merge_<kind>_params, else vLLM's older
        validate_or_generate_params, else `params` as they are."""
        merge = f"merge_{kind}_params"
        if overrides(self.processor, merge):
            merged = await self.call(merge, params)
        elif overrides(self.processor, "validate_or_generate_params"):
            merged = await self.call("validate_or_generate_params", params)
        else:
            return params
        return params if merged is None else merged  # vLLM plugins that change params in place return nothing

    async def response_value(self, value: Any) -> Any:
        """post_process's result through vLLM's older output_to_response, unwrapped from an IOProcessorResponse."""
        if overrides(self.processor, "output_to_response"):
            value = await self.call("output_to_response", value)
        if isinstance(value, IOProcessorResponse) or (hasattr(value, "data") and type(value).__name__ in (
                "IOProcessorResponse", "IOProcessorPluginResponse")):
            value = value.data
        return value

    def encode(self, value: Any, method: str = "post_process") -> msgspec.Raw:
        """The value as JSON: pydantic models through model_dump, the rest as msgspec encodes it."""
        try:
            return msgspec.Raw(msgspec.json.encode(value, enc_hook=_pydantic_hook))
        except (TypeError, ValueError, OverflowError, msgspec.MsgspecError) as exc:
            raise plugin_error(self.name, self.processor, method, 500,
                               f"returned a value that cannot be encoded as JSON: {type(exc).__name__}: {exc} "
                               "(return JSON values, msgspec Structs or pydantic models)") from exc

    async def _with_request_id(self, method: str, argument: Any) -> Any:
        function = getattr(self.processor, method)
        if _takes(function, "request_id"):
            return await self.call(method, argument, request_id=self.request_id)
        return await self.call(method, argument)


def _pydantic_hook(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    raise TypeError(f"{type(value).__qualname__} is not JSON-encodable (no model_dump)")


async def _indexed(outputs: list[Any]) -> Any:
    for index, output in enumerate(outputs):
        yield index, output


__all__ = ["RequestCalls", "overrides", "plugin_error"]
