"""POST /v1/chat/completions: the conversation through the chat template, one engine request with
`n` completions, reasoning and tool calls split out of the text by the configured parsers.

The template is rendered and its text tokenized in the engine's tokenizer pool, off the event loop;
a conversation the template cannot render is a 400. The request's outputs belong to the response
(response_scope.py): a client that leaves, at whatever moment, aborts it.

Parsers run per choice, on the text as it grows: the reasoning parser first (it separates the
reasoning from content), then the tool parser on the content. Each choice has parser instances of its
own, since streaming parsers keep state. The reasoning goes out as `reasoning` (vLLM's current name)
and, for one more release, also as `reasoning_content` (docs/server.md).
"""

from __future__ import annotations

import dataclasses

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec

from asyncengine.errors import EngineDeadError, EngineOverloadedError, RequestError
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.server.common import (
    SSE_DONE, ServingContext, TokenText, check_supported, engine_errors_as_http, first_then_rest,
    new_id, open_options, open_stream, request_chat_template, sampling_params, sse, sse_error, start_stream, usage,
)
from asyncengine.server.response_scope import ResponseScope
from asyncengine.server.serving_lora import resolve_model
from asyncengine.server.tool_choice import ForcedTools, forced_tools
from asyncengine.server.errors import ApiError, bad_request
from asyncengine.interfaces.parsers import DeltaFunctionCall, DeltaMessage, DeltaToolCall, ToolCall
from asyncengine.server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatMessage, ResponseMessage, TokenLogprob, TopLogprob,
)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the client sent them, as dicts (the fields it left out or sent null stay out); the
    frontend shapes them for the chat template (frontend/chat_messages.py) and refuses what it cannot read."""
    return [_without_nulls(msgspec.to_builtins(message)) for message in messages]


def _without_nulls(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = [part if isinstance(part, str) else {k: v for k, v in part.items() if v is not None}
                              for part in content]
    return {key: value for key, value in message.items() if value is not None}


def _tools_active(context: ServingContext, request: ChatCompletionRequest, forced: ForcedTools | None) -> bool:
    """Whether the output is parsed for tool calls: forced ones (tool_choice.py) always, 'auto' ones with
    the server's tool parser."""
    if forced is not None:
        return True
    if not request.tools or request.tool_choice == "none":
        return False
    if not (context.enable_auto_tool_choice and context.tool_parser is not None):
        raise bad_request("tools with tool_choice 'auto' need the server started with --enable-auto-tool-choice "
                          "and --tool-call-parser NAME (or tool_choice 'required' or a named function, which "
                          "need neither)", param="tools", code="unsupported_parameter")
    return True


@dataclass
class ChatParts:
    """A chat request as the engine takes it: what /v1/chat/completions runs and its /render shows."""

    context: ServingContext  # named after the LoRA adapter, when the request names one
    lora_request: Any
    forced: ForcedTools | None
    tools_active: bool
    messages: list[dict[str, Any]]
    chat_options: dict[str, Any]
    params: Any  # SamplingParams


async def chat_parts(context: ServingContext, request: ChatCompletionRequest) -> ChatParts:
    """The checks of a chat request (its model, fields, tools) and what the engine is given for it."""
    lora_request = await resolve_model(context, request.model)
    if lora_request is not None:  # the response names the adapter it ran, as vLLM's does
        context = dataclasses.replace(context, model_name=lora_request.lora_name)
    check_supported(request)
    forced = forced_tools(request)  # a 400 naming tool_choice when it is malformed
    tools_active = _tools_active(context, request, forced)
    if tools_active and forced is None and context.tool_parser is not None:
        # vLLM's hook: a parser whose calls begin with special tokens keeps them in the output.
        request = context.tool_parser(context.engine.tokenizer).adjust_request(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs", code="invalid_value")
    messages = message_dicts(request.messages)
    chat_options = dict(
        chat_template=request_chat_template(context, request.chat_template),
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        tools=[msgspec.to_builtins(tool) for tool in request.tools] if request.tools else None,
        documents=request.documents, template_kwargs=request.chat_template_kwargs,
    )
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = sampling_params(request, max_tokens=max_tokens, logprobs=logprobs,
                             structured_outputs=forced.structured_outputs if forced else None)
    return ChatParts(context, lora_request, forced, tools_active, messages, chat_options, params)


async def open_chat_outputs(parts: ChatParts, request: ChatCompletionRequest, request_id: str, *,
                            final_only: bool) -> AsyncGenerator[RequestOutput, None]:
    """The engine request of a chat request (not started: see open_stream), rendered through the chat
    template and tokenized in the engine's tokenizer pool, then validated; what is refused is a 400."""
    lora = {"lora_request": parts.lora_request} if parts.lora_request else {}
    try:
        return await open_stream(parts.context.engine, None, parts.params, request_id, messages=parts.messages,
                                 chat_options=parts.chat_options, add_special_tokens=bool(request.add_special_tokens),
                                 final_only=final_only, nowait=True, request=request,
                                 **open_options(request), **lora)
    except ApiError as error:
        forced = parts.forced
        if forced is not None and error.param == "structured_outputs.json":  # the schema came from the tools
            raise bad_request(f"{forced.param}: {error.message}", param=forced.param, code=error.code) from error
        if request.chat_template is not None and error.message.startswith("the chat template failed"):
            error.param = "chat_template"  # the request's own template: it may be at fault as much as the messages
        raise


async def create_chat_completion(context: ServingContext, request: ChatCompletionRequest, header_id: str | None,
                                 scope: ResponseScope) -> ChatCompletionResponse | AsyncIterator[bytes]:
    parts = await chat_parts(context, request)
    context, forced, tools_active = parts.context, parts.forced, parts.tools_active
    engine = context.engine
    response_id = new_id("chatcmpl", header_id)
    outputs = await open_chat_outputs(parts, request, header_id or response_id, final_only=not request.stream)
    shaper = ChatShaper(context, request, response_id, tools_active, TokenText(engine.tokenizer, as_ids=bool(request.return_tokens_as_token_ids)),
                         forced)
    if request.stream:
        scope.close_at_end(outputs)  # aborts the request however the response ends, even before the body starts
        first = await start_stream(outputs)
        return shaper.events(first_then_rest(first, outputs))
    final = None
    with engine_errors_as_http():
        async with aclosing(outputs):
            async for output in outputs:
                final = output
    if final is None:  # every request's stream ends with its final output
        raise RuntimeError(f"{response_id}: the engine ended the request without a final output")
    choices = [shaper.choice(c) for c in final.outputs]
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    return ChatCompletionResponse(id=response_id, created=shaper.created, model=context.model_name, choices=choices,
                                  usage=usage(len(final.prompt_token_ids), completion_tokens,
                                              context.cached_tokens([final])))


@dataclass
class _ChoiceState:
    """One choice of a stream: the text so far and its parsers' state."""

    reasoning: Any = None
    tools: Any = None
    text: str = ""
    content: str = ""
    role_sent: bool = False
    tool_called: bool = False
    # What the stream has sent, to send at the end what a parser still held back (see `_flush`).
    reasoning_sent: str = ""
    content_sent: str = ""
    tool_calls_sent: int = 0  # calls begun: one more than the highest index sent
    arguments_sent: dict[int, str] = dataclasses.field(default_factory=dict)  # per call index


class ChatShaper:
    """A chat request's outputs in the chat shape: whole choices, or a stream's chunks (the Responses API
    reads them too, serving_responses.py)."""

    def __init__(self, context: ServingContext, request: ChatCompletionRequest, response_id: str, tools_active: bool,
                 token_text: TokenText, forced: ForcedTools | None = None) -> None:
        self.context = context
        self.forced = forced
        self.request = request
        self.id = response_id
        self.created = int(time.time())
        self.tools_active = tools_active
        self.token_text = token_text
        self.top_logprobs = request.top_logprobs or 0
        self.states: dict[int, _ChoiceState] = {}

    def _parsers(self) -> tuple[Any, Any]:
        tokenizer = self.context.engine.tokenizer
        reasoning = self.context.reasoning_parser(tokenizer) if self.context.reasoning_parser else None
        if self.forced is not None:
            return reasoning, self.forced.parser()
        tools = self.context.tool_parser(tokenizer) if self.tools_active and self.context.tool_parser else None
        return reasoning, tools

    # -- whole responses -------------------------------------------------------------------------------

    def _parse_whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """A choice's whole text -> (reasoning, content, tool calls), through the configured parsers."""
        reasoning_parser, tool_parser = self._parsers()
        reasoning, content = (reasoning_parser.extract_reasoning(text, self.request)
                              if reasoning_parser else (None, text))
        tool_calls: list[ToolCall] = []
        if tool_parser is not None and content is not None:
            extracted = tool_parser.extract_tool_calls(content, self.request)
            if extracted.tools_called:
                tool_calls, content = extracted.tool_calls, extracted.content
        return reasoning, content, tool_calls

    def choice(self, completion: CompletionOutput) -> ChatChoice:
        reasoning, content, tool_calls = self._parse_whole(completion.text)
        finish_reason = completion.finish_reason
        if tool_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return ChatChoice(
            index=completion.index,
            message=ResponseMessage(content=content, reasoning=reasoning, reasoning_content=reasoning,
                                    tool_calls=tool_calls),
            logprobs=self._logprobs(completion), finish_reason=finish_reason, stop_reason=completion.stop_reason,
        )

    def _logprobs(self, completion: CompletionOutput) -> ChatLogprobs | None:
        if not self.request.logprobs:
            return None
        content = []
        for token_id, ranked in zip(completion.token_ids, completion.logprobs or []):
            token = self.token_text(token_id)
            best = sorted(ranked.items(), key=lambda item: -item[1])[: self.top_logprobs]
            content.append(TokenLogprob(
                token=token, logprob=ranked.get(token_id, float("-inf")), bytes=list(token.encode()),
                top_logprobs=[TopLogprob(token=(t := self.token_text(i)), logprob=lp, bytes=list(t.encode()))
                              for i, lp in best],
            ))
        return ChatLogprobs(content=content)

    # -- streams ---------------------------------------------------------------------------------------

    async def events(self, outputs: Any) -> AsyncIterator[bytes]:
        request = self.request
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        prompt_tokens = completion_tokens = 0
        last = []
        try:
            async for output in outputs:
                prompt_tokens = len(output.prompt_token_ids)
                last = [output]
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    for chunk in self.chunks(completion):
                        yield sse(chunk)
            if include_usage:
                yield sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.context.model_name,
                                              choices=[], usage=usage(prompt_tokens, completion_tokens,
                                                                      self.context.cached_tokens(last))))
            yield SSE_DONE
        except (RequestError, EngineOverloadedError, EngineDeadError) as error:
            yield sse_error(error)
        finally:
            with anyio.CancelScope(shield=True):
                await outputs.aclose()  # the client left early: abort the request

    def chunks(self, completion: CompletionOutput) -> list[ChatCompletionChunk]:
        state = self.states.get(completion.index)
        if state is None:
            state = self.states[completion.index] = _ChoiceState(*self._parsers())
        chunks = []
        if not state.role_sent:
            state.role_sent = True
            chunks.append(self._chunk(completion.index, DeltaMessage(role="assistant", content="")))
        delta = _count_sent(state, self._delta(state, completion.text) if completion.text else None)
        if completion.finish_reason is not None and (state.reasoning is not None or state.tools is not None):
            delta = _merge(delta, _count_sent(state, self._flush(state)))
        logprobs = self._logprobs(completion) if completion.token_ids else None
        finish_reason = completion.finish_reason
        if finish_reason == "stop" and state.tool_called:
            finish_reason = "tool_calls"
        if delta is not None or logprobs is not None or finish_reason is not None:
            chunks.append(self._chunk(completion.index, delta or DeltaMessage(), logprobs, finish_reason,
                                      completion.stop_reason if finish_reason else None))
        return chunks

    def _delta(self, state: _ChoiceState, delta_text: str) -> DeltaMessage | None:
        previous, state.text = state.text, state.text + delta_text
        if state.reasoning is not None:
            delta = state.reasoning.extract_reasoning_streaming(previous, state.text, delta_text, self.request)
        else:
            delta = DeltaMessage(content=delta_text)
        if delta is None or state.tools is None or not delta.content:
            return delta
        content_before, state.content = state.content, state.content + delta.content
        tool_delta = state.tools.extract_tool_calls_streaming(content_before, state.content, delta.content,
                                                              self.request)
        if tool_delta is not None and tool_delta.tool_calls:
            state.tool_called = True
        if delta.reasoning is None and tool_delta is None:
            return None
        return DeltaMessage(reasoning=delta.reasoning,
                            content=tool_delta.content if tool_delta else None,
                            tool_calls=tool_delta.tool_calls if tool_delta else None)

    def _flush(self, state: _ChoiceState) -> DeltaMessage | None:
        """At the end of a choice: what the whole text parses to, minus what the stream already sent.
        Streaming parsers hold back text that might begin a tag; with no more text coming, it is due."""
        reasoning, content, tool_calls = self._parse_whole(state.text)
        rest_reasoning = _rest(reasoning, state.reasoning_sent)
        rest_content = _rest(content, state.content_sent)
        missing = []
        for index, call in enumerate(tool_calls):
            if index >= state.tool_calls_sent:
                missing.append(DeltaToolCall(index=index, id=call.id, type=call.type, function=DeltaFunctionCall(
                    name=call.function.name, arguments=call.function.arguments)))
            elif rest_arguments := _rest(call.function.arguments, state.arguments_sent.get(index, "")):
                # a call the parser began streaming and the text ended before it sent all of it
                missing.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=rest_arguments)))
        if missing:
            state.tool_called = True
        if not (rest_reasoning or rest_content or missing):
            return None
        return DeltaMessage(reasoning=rest_reasoning, content=rest_content, tool_calls=missing or None)

    def _chunk(self, index: int, delta: DeltaMessage, logprobs: ChatLogprobs | None = None,
               finish_reason: str | None = None, stop_reason: Any = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.context.model_name,
            choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                     stop_reason=stop_reason)],
        )


def _count_sent(state: _ChoiceState, delta: DeltaMessage | None) -> DeltaMessage | None:
    if delta is not None:
        state.reasoning_sent += delta.reasoning or ""
        state.content_sent += delta.content or ""
        # A parser may send a call whole or in pieces (its id and name, then fragments of its arguments).
        for call in delta.tool_calls or []:
            state.tool_calls_sent = max(state.tool_calls_sent, call.index + 1)
            if call.function is not None and call.function.arguments:
                state.arguments_sent[call.index] = state.arguments_sent.get(call.index, "") + call.function.arguments
    return delta


def _rest(full: str | None, sent: str) -> str | None:
    """The part of `full` not sent yet, when what was sent is its beginning (else nothing: never resend)."""
    if not full or not full.startswith(sent) or len(full) == len(sent):
        return None
    return full[len(sent):]


def _merge(first: DeltaMessage | None, second: DeltaMessage | None) -> DeltaMessage | None:
    if first is None or second is None:
        return first or second
    def join(a, b):
        return a + b if a is not None and b is not None else (a if b is None else b)
    return DeltaMessage(role=first.role or second.role,
                        reasoning=join(first.reasoning, second.reasoning),
                        content=join(first.content, second.content),
                        tool_calls=(first.tool_calls or []) + (second.tool_calls or []) or None)
