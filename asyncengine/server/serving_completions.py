"""POST /v1/completions: one engine request per prompt, each with `n` completions.

Choice `index` is `prompt_index * n + completion_index`, as OpenAI numbers them. Text prompts are
tokenized in the engine's tokenizer pool, off the event loop. Without `stream` the prompts run
concurrently and the response comes when all have finished. With `stream`, each output becomes an
event as it comes; several prompts stream through one channel fed by a task per prompt. Those tasks
and every request's outputs belong to the response (response_scope.py): when the client goes away,
at whatever moment, they are cancelled and closed, which aborts the requests. The prompts of one
request share one request's fairness share of the engine's slots (docs/server.md, "Fairness"), and a
request with more sequences (prompts x n) than --max-waiting-requests is a 400, never a 503.

`echo` (docs/server.md, "Fields"): each choice's text begins with its prompt's text (a prompt of token
ids: their decoded text), in a stream in the choice's first chunk, as vLLM's does.
"""

from __future__ import annotations

import dataclasses

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, cast

import anyio

from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.server.common import (
    SSE_DONE, ServingContext, TokenText, check_supported, check_tokenizer, final_outputs,
    first_then_rest, new_id, open_options, open_stream, sampling_params, sse, sse_error, start_stream, usage,
)
from asyncengine.server.response_scope import ResponseScope
from asyncengine.server.serving_lora import resolve_model
from asyncengine.server.errors import bad_request, from_engine_error
from asyncengine.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from asyncengine.errors import EngineDeadError, EngineOverloadedError, RequestError

if TYPE_CHECKING:
    from asyncengine.frontend.engine_client import EngineClient


def prompts_of(request: CompletionRequest) -> list[str | list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        # (cast: each all(...) has just checked the items' type)
        if all(isinstance(p, str) for p in prompt):
            return list(cast(list[str], prompt))
        if all(_is_token_id(t) for t in prompt):
            return [list(cast(list[int], prompt))]
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            return [list(p) for p in cast(list[list[int]], prompt)]
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of lists of token "
                      f"ids; got {type(prompt).__name__}" + (" (empty)" if prompt in ([], "") else ""),
                      param="prompt", code="invalid_value")


def _check_room(engine: EngineClient, num_prompts: int, n: int) -> None:
    """A request whose sequences (prompts x n) outnumber the places of the waiting queue could never be
    admitted: a 400 saying so, not a 503 that no retry can fix. (`n` alone over it is the processor's
    400 naming `n`; an n out of its range is refused there too.)"""
    capacity = engine.config.max_waiting_requests
    if num_prompts > 1 and 1 <= n <= capacity and num_prompts * n > capacity:
        raise bad_request(f"this request has {num_prompts} prompts" + (f" with n={n} each" if n > 1 else "")
                          + f": {num_prompts * n} sequences, more than the server ever queues at once "
                          f"(--max-waiting-requests {capacity}); send at most {capacity // n} prompts per request, "
                          "or start the server with a larger --max-waiting-requests",
                          param="prompt", code="too_many_prompts")


async def _prompt_text(engine: EngineClient, prompt: str | list[int], request: CompletionRequest) -> str:
    """The text of a prompt as the engine runs it, for echo: token ids decoded (in the tokenizer pool)."""
    if engine.tokenizer is None:
        return ""
    truncate = request.truncate_prompt_tokens
    if isinstance(prompt, str):
        prompt = await engine.tokenize(prompt, add_special_tokens=request.add_special_tokens)
    if truncate is not None:
        prompt = prompt[-(truncate if truncate > 0 else engine.model_config.max_model_len):]
    return await engine.detokenize(prompt)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def create_completion(context: ServingContext, request: CompletionRequest, header_id: str | None,
                            scope: ResponseScope) -> CompletionResponse | AsyncIterator[bytes]:
    lora_request = await resolve_model(context, request.model)
    if lora_request is not None:  # the response names the adapter it ran, as vLLM's does
        context = dataclasses.replace(context, model_name=lora_request.lora_name)
    check_supported(request)
    engine = context.engine
    response_id = new_id("cmpl", header_id)
    tokenizer = engine.tokenizer
    prompts = prompts_of(request)
    _check_room(engine, len(prompts), request.n)
    # The prompts of one request count as one request for fairness: together they hold at most its share of
    # the engine's slots (docs/server.md, "Fairness").
    group = engine.request_group() if len(prompts) > 1 else None
    request_ids = [header_id if header_id and index == 0 else f"{header_id or response_id}-{index}"
                   for index in range(len(prompts))]
    streams = []  # every prompt is validated before any runs
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            check_tokenizer(engine)
        params = sampling_params(request, max_tokens=request.max_tokens, logprobs=request.logprobs)
        streams.append(await open_stream(engine, prompt, params, request_ids[index],
                                         add_special_tokens=request.add_special_tokens,
                                         final_only=not request.stream, nowait=True, group=group,
                                         request=request, **open_options(request),
                                         **({"lora_request": lora_request} if lora_request else {})))
    shaper = _Shaper(context, response_id, request,
                     TokenText(tokenizer, as_ids=bool(request.return_tokens_as_token_ids)))
    if request.echo:
        for index, prompt in enumerate(prompts):
            if not isinstance(prompt, str) or request.truncate_prompt_tokens is not None:
                shaper.echo_texts[request_ids[index]] = await _prompt_text(engine, prompt, request)
    if request.stream:
        return await _stream(streams, shaper, request, scope)
    finals = await final_outputs(streams)
    return shaper.response(finals)


class _Shaper:
    """Engine outputs -> OpenAI's completion objects."""

    def __init__(self, context: ServingContext, response_id: str, request: CompletionRequest,
                 token_text: TokenText) -> None:
        self.id = response_id
        self.created = int(time.time())
        self.model = context.model_name
        self.context = context
        self.n = request.n
        self.want_logprobs = request.logprobs is not None
        self.token_text = token_text
        self.offsets: dict[int, int] = {}  # choice index -> text offset so far (streams)
        self.echo = request.echo
        self.echo_texts: dict[str, str] = {}  # request id -> its prompt's text, when it is not `output.prompt`
        self.echoed: set[int] = set()  # choice indexes whose prompt text went out already

    def choice(self, prompt_index: int, completion: CompletionOutput, prompt: str | None = None) -> CompletionChoice:
        index = prompt_index * self.n + completion.index
        logprobs = None
        if self.want_logprobs:
            logprobs = self._logprobs(index, completion)
        text = completion.text
        if self.echo and index not in self.echoed:
            self.echoed.add(index)
            text = (prompt or "") + text
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)

    def _logprobs(self, index: int, completion: CompletionOutput) -> CompletionLogprobs:
        result = CompletionLogprobs()
        offset = self.offsets.get(index, 0)
        for token_id, ranked in zip(completion.token_ids, completion.logprobs or []):
            text = self.token_text(token_id)
            result.tokens.append(text)
            result.token_logprobs.append(ranked.get(token_id))
            result.top_logprobs.append({self.token_text(t): lp for t, lp in ranked.items()})
            result.text_offset.append(offset)
            offset += len(text)
        self.offsets[index] = offset
        return result

    def response(self, finals: list[RequestOutput | None]) -> CompletionResponse:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        cached_tokens = self.context.cached_tokens(output for output in finals if output is not None)
        for prompt_index, output in enumerate(finals):
            if output is None:
                continue  # cannot happen: every task ran to its final output or raised
            prompt_tokens += len(output.prompt_token_ids)
            for completion in output.outputs:
                completion_tokens += len(completion.token_ids)
                choices.append(self.choice(prompt_index, completion, self.prompt_text(output)))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=usage(prompt_tokens, completion_tokens, cached_tokens))

    def chunk(self, prompt_index: int, output: RequestOutput) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=[self.choice(prompt_index, c, self.prompt_text(output))
                                           for c in output.outputs])

    def prompt_text(self, output: RequestOutput) -> str | None:
        """What `echo` puts before a choice: the prompt as the engine took it (truncate_prompt_tokens
        applied), or the text of its token ids (decoded in `echo_texts`, off the event loop)."""
        if not self.echo:
            return None
        return self.echo_texts.get(output.request_id, output.prompt)


async def _stream(streams: list[AsyncGenerator[RequestOutput, None]], shaper: _Shaper, request: CompletionRequest,
                  scope: ResponseScope) -> AsyncIterator[bytes]:
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    if len(streams) == 1:
        outputs = streams[0]
        scope.close_at_end(outputs)  # also when the body never starts
        first = await start_stream(outputs)  # errors before the first byte are HTTP errors
        tagged = _tag(0, first_then_rest(first, outputs))
    else:
        tagged = await _fan_in(streams, scope)
    return _events(tagged, shaper, include_usage, num_prompts=len(streams))


async def _tag(prompt_index: int, outputs: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    try:
        async for output in outputs:
            yield prompt_index, output
    finally:
        with anyio.CancelScope(shield=True):
            await outputs.aclose()  # `async for` leaves an inner generator open: close it, aborting the request


async def _events(tagged: AsyncGenerator[tuple[int, RequestOutput], None], shaper: _Shaper, include_usage: bool,
                  *, num_prompts: int) -> AsyncIterator[bytes]:
    prompt_tokens: dict[int, int] = {}
    last: dict[int, RequestOutput] = {}  # each prompt's latest output: its prefix-cache hits
    completion_tokens = 0
    try:
        async for prompt_index, output in tagged:
            prompt_tokens[prompt_index] = len(output.prompt_token_ids)
            last[prompt_index] = output
            completion_tokens += sum(len(c.token_ids) for c in output.outputs)
            chunk = shaper.chunk(prompt_index, output)
            if chunk.choices:
                yield sse(chunk)
        if include_usage:
            yield sse(CompletionResponse(id=shaper.id, created=shaper.created, model=shaper.model, choices=[],
                                         usage=usage(sum(prompt_tokens.values()), completion_tokens,
                                                     shaper.context.cached_tokens(last.values()))))
        yield SSE_DONE
    except (RequestError, EngineOverloadedError, EngineDeadError) as error:
        yield sse_error(error)
    finally:
        with anyio.CancelScope(shield=True):
            await tagged.aclose()  # the client left early: abort what still runs


async def _fan_in(streams: list[AsyncGenerator[RequestOutput, None]],
                  scope: ResponseScope) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Several prompts' outputs through one channel, each fed by a task of the response's scope. The
    returned generator cancels them all when it is closed; the scope does when the response ends
    without it (the client left before the body started). Either way their requests are aborted.

    The body starts with the first prompt's first output, not every prompt's: the prompts of one request
    hold one request's share of the engine's slots, so the last may start only when the first end. A
    failure before that (a full queue answers each prompt's admission at once, a refused request with its
    first output) is the response's HTTP error; one after it, an error event in the stream."""
    send, receive = anyio.create_memory_object_stream[tuple[int, Any]](len(streams) * 4)
    scope.close_at_end(receive)
    scopes = [anyio.CancelScope() for _ in streams]
    first = anyio.Event()  # some prompt produced its first output, or failed
    failures: list[BaseException] = []

    async def produce(index: int) -> None:
        with scopes[index]:
            try:
                # aclosing: a cancelled `async for` would leave the generator, and its request, open.
                async with aclosing(streams[index]) as outputs:
                    async for output in outputs:
                        first.set()
                        await send.send((index, output))
            except (RequestError, EngineOverloadedError, EngineDeadError) as error:
                failures.append(error)
                first.set()
                await send.send((index, error))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass  # the body was closed: nobody reads any more, and the request is aborted already
            finally:
                first.set()

    for index in range(len(streams)):
        scope.start_soon(produce, index, name=f"completion prompt {index}")
    await first.wait()
    if failures:
        for cancel_scope in scopes:
            cancel_scope.cancel()
        raise from_engine_error(failures[0])
    return _drain(receive, scopes, len(streams))


async def _drain(receive: Any, scopes: list[anyio.CancelScope], count: int) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    finished = 0
    try:
        async with receive:
            while finished < count:
                index, item = await receive.receive()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    finished += 1
                yield index, item
    finally:
        for scope in scopes:
            scope.cancel()
