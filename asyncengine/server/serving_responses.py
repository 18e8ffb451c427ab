"""OpenAI's Responses API: POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel.

A Responses request is run as the chat request it amounts to (responses_conversation.py): the same chat
template, tool_choice, parsers and structured output as /v1/chat/completions, through serving_chat's
`chat_parts`, `open_chat_outputs` and `ChatShaper`. Only the shape differs: the parsed text becomes
output items (responses_output.py), a stream becomes OpenAI's typed events (`event: TYPE` with a
`data:` JSON carrying `sequence_number`; no `[DONE]`, as OpenAI sends none).

With `store` (the default) a finished response is kept in the bounded store (responses_store.py) for
GET, for `previous_response_id` and for cancel. `background: true` answers at once with status
"queued"; the request runs in the app's task group (it belongs to the server, not to the HTTP
response that started it), and cancel cancels it there, which aborts its engine request.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import msgspec
from quart import Response, g, request

from asyncengine.errors import EngineDeadError, EngineOverloadedError, RequestError
from asyncengine.outputs import RequestOutput
from asyncengine.server.common import ServingContext, TokenText, final_outputs, first_then_rest, start_stream
from asyncengine.server.errors import ApiError, bad_request, from_engine_error
from asyncengine.interfaces.parsers import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from asyncengine.server.protocol_responses import (
    ErrorEvent, IncompleteDetails, InputTokensDetails, ResponseCompletedEvent, ResponseCreatedEvent, ResponseError,
    ResponseFailedEvent, ResponseIncompleteEvent, ResponseInProgressEvent, ResponsesRequest, ResponsesResponse,
    ResponseUsage, StreamEvent, TextConfig, TextFormat,
)
from asyncengine.server.response_scope import ResponseScope, current_response_scope
from asyncengine.server.responses_conversation import (
    chat_request, check_request_fields, input_messages, output_messages, responses_error,
)
from asyncengine.server.responses_output import OutputBuilder, response_logprobs
from asyncengine.server.responses_store import ResponseStore, StoredResponse
from asyncengine.server.serving_chat import ChatParts, ChatShaper, chat_parts, open_chat_outputs

RESPONSES_ROUTES: list[tuple[str, str, str]] = [
    ("/v1/responses", "POST", "responses_create"),
    ("/v1/responses/<response_id>", "GET", "responses_retrieve"),
    ("/v1/responses/<response_id>/cancel", "POST", "responses_cancel"),
]
ENGINE_ERRORS = (RequestError, EngineOverloadedError, EngineDeadError)
logger = logging.getLogger("asyncengine.server")


def responses_views(app: Any, context: ServingContext, store: ResponseStore,
                    decode_body: Callable[[type], Awaitable[Any]], json_response: Callable[[Any], Response],
                    sse_response: Callable[[AsyncIterator[bytes]], Response],
                    ) -> dict[str, Callable[..., Coroutine[Any, Any, Response]]]:
    """The views of RESPONSES_ROUTES, by view name (routes.py registers them). Background responses run
    in `app.nursery`, the task group the app serves in."""

    async def responses_create() -> Response:
        body = await decode_body(ResponsesRequest)
        result = await create_response(context, store, body, g.request_id, current_response_scope(), app.nursery)
        return json_response(result) if isinstance(result, ResponsesResponse) else sse_response(result)

    async def responses_retrieve(response_id: str) -> Response:
        if request.args.get("stream", "false").lower() not in ("false", "0"):
            raise bad_request("stream=true (replaying a background response's events) is not supported: GET the "
                              "response without it", param="stream", code="unsupported_parameter")
        return json_response(_stored(store, response_id).response)

    async def responses_cancel(response_id: str) -> Response:
        return json_response(await cancel_response(store, response_id))

    return {"responses_create": responses_create, "responses_retrieve": responses_retrieve,
            "responses_cancel": responses_cancel}


def _stored(store: ResponseStore, response_id: str, param: str = "response_id") -> StoredResponse:
    entry = store.get(response_id)
    if entry is None:
        why = ("it was never stored (store false), or was evicted (the store keeps the newest "
               f"{store.max_entries} responses, {store.max_bytes} bytes at most), or the server restarted"
               if store.enabled else "the server's response store is off (--responses-store-max-entries 0)")
        raise ApiError(404, f"No response with id {response_id!r}: {why}", type="invalid_request_error",
                       param=param, code="response_not_found")
    return entry


@contextmanager
def _named_for_responses(body: ResponsesRequest) -> Iterator[None]:
    """Errors of the chat machinery, with the Responses field they concern."""
    try:
        yield
    except ApiError as error:
        raise responses_error(error, body) from error


# -- POST /v1/responses ---------------------------------------------------------------------------------


async def create_response(context: ServingContext, store: ResponseStore, body: ResponsesRequest,
                          header_id: str | None, scope: ResponseScope,
                          task_group: Any) -> ResponsesResponse | AsyncIterator[bytes]:
    check_request_fields(body)
    if body.background:
        _check_background(body, store)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = _stored(store, body.previous_response_id, param="previous_response_id")
        if previous.running:
            raise bad_request(f"response {body.previous_response_id!r} is still {previous.response.status}: continue "
                              "it once it has finished", param="previous_response_id", code="invalid_value")
        history = previous.messages
    conversation = history + input_messages(body.input)
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat = chat_request(body, instructions + conversation)
    with _named_for_responses(body):
        parts = await chat_parts(context, chat)
    response_id = f"resp_{header_id or secrets.token_hex(12)}"
    run = _Run(parts, chat, body, store, conversation, _initial(parts.context.model_name, response_id, body))
    with _named_for_responses(body):
        outputs = await open_chat_outputs(parts, chat, header_id or response_id, final_only=not body.stream)
    if body.background:
        entry = StoredResponse(msgspec.structs.replace(run.base, status="queued"), conversation,
                               cancel_scope=anyio.CancelScope(), done=anyio.Event())
        store.put(entry)
        task_group.start_soon(run.in_background, entry, outputs, name=f"background response {response_id}")
        return entry.response
    if body.stream:
        scope.close_at_end(outputs)  # aborts the request however the response ends, even before the body starts
        with _named_for_responses(body):
            first = await start_stream(outputs)
        return run.events(first_then_rest(first, outputs))
    with _named_for_responses(body):
        (final,) = await final_outputs([outputs])
    return run.finish(run.whole(final), final)


def _check_background(body: ResponsesRequest, store: ResponseStore) -> None:
    if not body.store:
        raise bad_request("background needs store: a background response is only ever read back from the store",
                          param="background", code="invalid_value")
    if not store.enabled:
        raise bad_request("background needs the response store, which this server has off "
                          "(--responses-store-max-entries 0)", param="background", code="unsupported_parameter")
    if body.stream:
        raise bad_request("background with stream is not supported: create the background response, then GET it "
                          "until its status is final", param="stream", code="unsupported_parameter")


def _initial(model: str, response_id: str, body: ResponsesRequest) -> ResponsesResponse:
    """The response object before any output: what it echoes of the request."""
    return ResponsesResponse(
        id=response_id, created_at=int(time.time()), model=model, status="in_progress", output=[],
        instructions=body.instructions, metadata=dict(body.metadata or {}),
        parallel_tool_calls=body.parallel_tool_calls is not False, temperature=body.temperature, top_p=body.top_p,
        tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
        tools=[{key: value for key, value in msgspec.to_builtins(tool).items() if value is not None}
               for tool in body.tools or []],
        max_output_tokens=body.max_output_tokens, previous_response_id=body.previous_response_id,
        reasoning=body.reasoning, text=body.text or TextConfig(format=TextFormat()),
        truncation=body.truncation or "disabled", user=body.user,
        store=body.store, background=body.background)


class _Run:
    """One response being made: its chat parts, its output builder, and what finishing it stores."""

    def __init__(self, parts: ChatParts, chat: Any, body: ResponsesRequest, store: ResponseStore,
                 conversation: list[dict[str, Any]], base: ResponsesResponse) -> None:
        context = parts.context
        self.shaper = ChatShaper(context, chat, base.id, parts.tools_active, TokenText(context.engine.tokenizer),
                                 parts.forced)
        self.body = body
        self.store = store
        self.conversation = conversation
        self.base = base
        self.builder = OutputBuilder()

    def whole(self, final: RequestOutput | None) -> str | None:
        """A finished request's output items, parsed from its whole text; its finish reason."""
        if final is None or not final.outputs:  # every request's stream ends with its final output
            raise RuntimeError(f"{self.base.id}: the engine ended the request without a final output")
        choice = self.shaper.choice(final.outputs[0])
        message = choice.message
        calls = [DeltaToolCall(index=index, id=call.id, function=DeltaFunctionCall(
            name=call.function.name, arguments=call.function.arguments)) for index, call in enumerate(message.tool_calls)]
        self.builder.add(DeltaMessage(reasoning=message.reasoning, content=message.content, tool_calls=calls or None),
                         response_logprobs(choice.logprobs))
        return choice.finish_reason

    def finish(self, finish_reason: str | None, final: RequestOutput | None,
               output_tokens: int | None = None) -> ResponsesResponse:
        """The finished response, stored when the request asked for it. Its open item is closed here
        (a stream has closed it already, to send the events that say so)."""
        status = {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "", "completed")
        self.builder.finish("incomplete" if status == "incomplete" else "completed")
        prompt_tokens = len(final.prompt_token_ids) if final is not None else 0
        if output_tokens is None:
            output_tokens = len(final.outputs[0].token_ids) if final is not None and final.outputs else 0
        response = msgspec.structs.replace(
            self.base, status=status, output=list(self.builder.items), completed_at=int(time.time()),
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            usage=ResponseUsage(input_tokens=prompt_tokens, output_tokens=output_tokens,
                                total_tokens=prompt_tokens + output_tokens,
                                input_tokens_details=InputTokensDetails(
                                    cached_tokens=final.num_cached_tokens if final is not None else 0)))
        if self.body.store and self.store.enabled:
            self.store.put(StoredResponse(response, self.conversation + output_messages(response.output)))
        return response

    async def events(self, outputs: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[bytes]:
        """The stream's events, numbered from 0."""
        numbered = _Numbered()
        in_progress = self.base
        yield numbered(ResponseCreatedEvent(response=in_progress))
        yield numbered(ResponseInProgressEvent(response=in_progress))
        final, finish_reason, output_tokens = None, None, 0
        try:
            async for output in outputs:
                final = output
                for completion in output.outputs:
                    output_tokens += len(completion.token_ids)
                    for chunk in self.shaper.chunks(completion):
                        choice = chunk.choices[0]
                        finish_reason = choice.finish_reason or finish_reason
                        for event in self.builder.add(choice.delta, response_logprobs(choice.logprobs)):
                            yield numbered(event)
            status = "incomplete" if finish_reason == "length" else "completed"
            for event in self.builder.finish(status):
                yield numbered(event)
            response = self.finish(finish_reason, final, output_tokens)
            end = ResponseIncompleteEvent if response.status == "incomplete" else ResponseCompletedEvent
            yield numbered(end(response=response))
        except ENGINE_ERRORS as error:
            api_error = from_engine_error(error)
            yield numbered(ErrorEvent(message=api_error.message, code=api_error.code, param=api_error.param))
            failed = msgspec.structs.replace(self.base, status="failed", output=list(self.builder.items),
                                             error=ResponseError(code=_error_code(api_error), message=api_error.message))
            yield numbered(ResponseFailedEvent(response=failed))
        finally:
            with anyio.CancelScope(shield=True):
                await outputs.aclose()  # the client left early: abort the request

    async def in_background(self, entry: StoredResponse, outputs: AsyncGenerator[RequestOutput, None]) -> None:
        """Run a background response to its end, in the app's task group; its entry in the store says how
        it went. Cancelling `entry.cancel_scope` (POST .../cancel) aborts its engine request."""
        try:
            with entry.cancel_scope or anyio.CancelScope():
                entry.response.status = "in_progress"
                try:
                    (final,) = await final_outputs([outputs])
                    self.finish(self.whole(final), final)
                except ApiError as error:  # the engine refused it, or died
                    self._failed(entry, responses_error(error, self.body))
                except Exception as error:  # noqa: BLE001 (see below)
                    # A bug of ours or of a parser plugin's. In the foreground it would be the app's 500
                    # (logged with its traceback under the request id); here no HTTP response is waiting, and
                    # raising would end the app's task group, so: the same log line, and a failed response.
                    logger.error("background response %s failed", entry.response.id, exc_info=error)
                    self._failed(entry, ApiError(500, f"internal error (response {entry.response.id})",
                                                 type="internal_error", code="internal_error"))
        finally:
            with anyio.CancelScope(shield=True):
                await outputs.aclose()
            if entry.done is not None:
                entry.done.set()

    def _failed(self, entry: StoredResponse, error: ApiError) -> None:
        failed = msgspec.structs.replace(entry.response, status="failed", completed_at=int(time.time()),
                                         error=ResponseError(code=_error_code(error), message=error.message))
        self.store.put(StoredResponse(failed, entry.messages))


def _error_code(error: ApiError) -> str:
    """An HTTP error as the `code` of a failed response (OpenAI's values)."""
    if error.code == "engine_overloaded":
        return "rate_limit_exceeded"
    return "server_error" if error.status >= 500 else "invalid_prompt"


class _Numbered:
    """Server-sent events of a Responses stream, each with the next sequence number."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, event: StreamEvent) -> bytes:
        event.sequence_number, self.next = self.next, self.next + 1
        kind = type(event).__struct_config__.tag
        return b"event: " + str(kind).encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


# -- POST /v1/responses/{id}/cancel ---------------------------------------------------------------------


async def cancel_response(store: ResponseStore, response_id: str) -> ResponsesResponse:
    """Cancel a background response: a running one is aborted (its status "cancelled"); a cancelled one
    is answered as it is; any other is a 400 (OpenAI cancels only background responses)."""
    entry = _stored(store, response_id)
    response = entry.response
    if not response.background:
        raise bad_request(f"response {response_id!r} was not created with background: true; only background "
                          "responses can be cancelled", param="response_id", code="invalid_value")
    if response.status == "cancelled":
        return response
    if not entry.running:
        raise bad_request(f"response {response_id!r} has already finished (status {response.status!r}): there is "
                          "nothing to cancel", param="response_id", code="invalid_value")
    entry.response = msgspec.structs.replace(response, status="cancelled", completed_at=int(time.time()))
    if entry.cancel_scope is not None:
        entry.cancel_scope.cancel()
    if entry.done is not None:
        await entry.done.wait()  # its engine request aborted, its task ended
    store.put(entry)
    return entry.response
