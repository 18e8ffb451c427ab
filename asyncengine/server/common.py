"""What the completion and chat routes share: sampling parameters from a request, the model check,
request ids, tokenizing and chat rendering (in the engine's tokenizer pool, off the event loop), token
strings for logprobs, server-sent events, and taking a request's first output before the response
starts (so that overload and bad input still get an HTTP status)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from asyncengine.errors import EngineDeadError, EngineOverloadedError, RequestError
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams
from asyncengine.server.errors import ApiError, bad_request, from_engine_error
from asyncengine.server.protocol import PromptTokensDetails, SamplingFields, Usage
from asyncengine.structured_output.openai_fields import GUIDED_KEYS

if TYPE_CHECKING:
    from asyncengine.frontend.engine_client import EngineClient

# Request fields passed to SamplingParams only when the client set them, so that the model's
# generation_config.json supplies the defaults of the others (as vLLM does).
_OPTIONAL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_tokens")


@dataclass
class ServingContext:
    """What a route needs from the server: the engine and the names it answers to."""

    engine: EngineClient
    model_name: str  # the name responses report: the first --served-model-name
    max_model_len: int
    chat_template: str | None = None
    tool_parser: type | None = None  # chosen by --tool-call-parser
    enable_auto_tool_choice: bool = False
    reasoning_parser: type | None = None  # chosen by --reasoning-parser
    io_processor: Any = None  # the SelectedIOProcessor chosen by --io-processor-plugin (serving_io_processor.py)
    model_aliases: tuple[str, ...] = ()  # the other --served-model-name names, which requests may use too
    trust_request_chat_template: bool = False  # --trust-request-chat-template: a request may set chat_template
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens in responses

    def cached_tokens(self, outputs: Any) -> int | None:
        """The prefix-cache hits of the requests' `outputs` (RequestOutputs) for usage, when reported."""
        return sum(output.num_cached_tokens for output in outputs) if self.enable_prompt_tokens_details else None

    def serves(self, model: str | None) -> bool:
        """Whether a request's `model` names the served (base) model: absent, or one of its names."""
        return model is None or model == self.model_name or model in self.model_aliases


def check_model(context: ServingContext, model: str | None) -> None:
    if not context.serves(model):
        raise ApiError(404, f"The model `{model}` does not exist; this server serves {context.model_name!r}",
                       type="NotFoundError", param="model", code="model_not_found")


def check_supported(request: Any) -> None:
    for param, message in request.unsupported():
        raise bad_request(message, param=param, code="unsupported_parameter")


def new_id(prefix: str, header_id: str | None) -> str:
    return f"{prefix}-{header_id or secrets.token_hex(12)}"


def sampling_params(request: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    structured_outputs: Any = None) -> SamplingParams:
    """SamplingParams for `request`; a bad value is a 400 naming its field. The rules that need the
    prompt (the context length among them) are the frontend's, checked when the engine takes the
    request (`AsyncEngine.open_stream`). `structured_outputs`: a constraint the route chose itself
    (a forced tool call), in place of the request's response_format and structured_outputs."""
    from asyncengine.structured_output.openai_fields import from_request

    values: dict[str, Any] = {
        "n": request.n,
        "ignore_eos": request.ignore_eos,
        "skip_special_tokens": request.skip_special_tokens,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "max_tokens": max_tokens,
    }
    for name in _OPTIONAL_FIELDS:
        value = getattr(request, name)
        if value is not None:
            values[name] = value
    if request.stop is not None:
        values["stop"] = [request.stop] if isinstance(request.stop, str) else list(request.stop)
    if request.stop_token_ids is not None:
        values["stop_token_ids"] = list(request.stop_token_ids)
    if logprobs is not None:
        values["logprobs"] = logprobs
    if request.vllm_xargs is not None:
        values["extra_args"] = dict(request.vllm_xargs)
    for name in ("logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens"):
        if getattr(request, name) is not None:
            values[name] = getattr(request, name)
    try:
        structured = structured_outputs or from_request(request.response_format, request.structured_outputs,
                                                        guided_fields(request))
        if structured is not None:
            values["structured_outputs"] = structured
        return SamplingParams(**values)
    except RequestError as error:
        raise from_engine_error(error) from error


def guided_fields(request: SamplingFields) -> dict[str, Any]:
    """vLLM's older `guided_*` fields the request set, by name."""
    return {name: value for name in GUIDED_KEYS if (value := getattr(request, name)) is not None}


def open_options(request: SamplingFields) -> dict[str, Any]:
    """`engine.open_stream`'s options from vLLM's per-request scheduling fields (priority, cache_salt)."""
    options: dict[str, Any] = {}
    if request.priority:
        options["priority"] = request.priority
    if request.cache_salt is not None:
        options["cache_salt"] = request.cache_salt
    return options


def request_chat_template(context: ServingContext, chat_template: str | None) -> str | None:
    """The chat template a request renders with: its own (vLLM's `chat_template` field, which only
    --trust-request-chat-template allows: it is code the server runs), else the server's."""
    if chat_template is None:
        return context.chat_template
    if not context.trust_request_chat_template:
        raise bad_request("chat_template in a request needs the server started with --trust-request-chat-template "
                          "(a template is code the server runs); leave it out to use the server's template",
                          param="chat_template", code="untrusted_chat_template")
    return chat_template


def check_tokenizer(engine: EngineClient) -> None:
    """Text prompts need the tokenizer: without one (skip_tokenizer_init) a 400 saying to send token ids."""
    if engine.tokenizer is None:
        raise bad_request("text prompts need a tokenizer, but the server runs with skip_tokenizer_init: send "
                          "token ids", param="prompt", code="no_tokenizer")


async def tokenize_prompt(engine: EngineClient, text: str, *, add_special_tokens: bool) -> list[int]:
    """The token ids of a text prompt, tokenized off the event loop (the engine's tokenizer pool)."""
    check_tokenizer(engine)
    try:
        return await engine.tokenize(text, add_special_tokens=add_special_tokens)
    except RequestError as error:
        raise from_engine_error(error) from error


async def chat_prompt_text(engine: EngineClient, messages: list[dict[str, Any]], **render_options: Any) -> str:
    """A conversation through the chat template, off the event loop; what is wrong with it is a 400."""
    try:
        return await engine.render_chat(messages, **render_options)
    except RequestError as error:
        raise from_engine_error(error) from error


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
    """`cached_tokens`: the prompt tokens the prefix cache served, given with --enable-prompt-tokens-details."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=None if cached_tokens is None else PromptTokensDetails(
                     cached_tokens=cached_tokens))


def sse(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(error: Exception) -> bytes:
    """A failure after the stream began (the status line is gone): an error event, then the stream ends."""
    api_error = from_engine_error(error) if isinstance(error, (RequestError, EngineOverloadedError, EngineDeadError)) \
        else ApiError(500, f"{type(error).__name__}: {error}", type="internal_error")
    return b"data: " + api_error.body() + b"\n\n"


class TokenText:
    """Token id -> its text, for logprobs (cached: the same ids recur); "token_id:N" without a tokenizer or
    with `as_ids` (vLLM's return_tokens_as_token_ids)."""

    def __init__(self, tokenizer: Any, *, as_ids: bool = False) -> None:
        self._decode = lru_cache(maxsize=65536)(self._decode_one)
        self._tokenizer = None if as_ids else tokenizer
        self.tokenizer = tokenizer

    def _decode_one(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id])

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


async def start_stream(outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    """The first output of a request, taken before any response byte is sent; on failure (or when the
    client leaves meanwhile) the request is aborted and the error raised as an HTTP error."""
    try:
        return await outputs.__anext__()
    except (RequestError, EngineOverloadedError, EngineDeadError) as error:
        with anyio.CancelScope(shield=True):
            await outputs.aclose()
        raise from_engine_error(error) from error
    except BaseException:
        with anyio.CancelScope(shield=True):
            await outputs.aclose()
        raise


async def first_then_rest(first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None]):
    """Iterate a request's outputs again from the one `start_stream` took; closing it closes `outputs`
    (which aborts the request if it has not finished)."""
    try:
        yield first
        if first.finished:
            return
        async for output in outputs:
            yield output
    finally:
        with anyio.CancelScope(shield=True):
            await outputs.aclose()


@contextmanager
def engine_errors_as_http() -> Iterator[None]:
    """Around a task group of requests: the first engine error among its failures, as an HTTP error."""
    try:
        yield
    except BaseExceptionGroup as group:
        matched, _ = group.split((RequestError, EngineOverloadedError, EngineDeadError))
        if matched is None:
            raise
        first: BaseException = matched
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise from_engine_error(first) from group
    except (RequestError, EngineOverloadedError, EngineDeadError) as error:
        raise from_engine_error(error) from error


async def open_stream(engine: EngineClient, *args: Any, request: SamplingFields | None = None,
                      **options: Any) -> AsyncGenerator[RequestOutput, None]:
    """`engine.open_stream(...)` (render, tokenize, validate; the stream not started yet), with what the
    engine refuses as an HTTP error, naming the field as `request` sent it (a guided_* field: the engine
    names the structured_outputs key it became)."""
    try:
        return await engine.open_stream(*args, **options)
    except (RequestError, EngineDeadError) as error:
        api_error = from_engine_error(error)
        for name in guided_fields(request) if request is not None else ():
            engine_name = f"structured_outputs.{GUIDED_KEYS[name]}"
            if api_error.param is not None and (api_error.param == engine_name
                                                or api_error.param.startswith(engine_name + ".")):
                api_error.param = name + api_error.param[len(engine_name):]
                api_error.message = api_error.message.replace(engine_name, name)
        raise api_error from error


async def final_outputs(streams: list[AsyncGenerator[RequestOutput, None]]) -> list[RequestOutput | None]:
    """Run every request (streams opened with `final_only`) to its final output, concurrently, in a task
    group of its own; the first engine error among them becomes an HTTP error (and cancels the rest)."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def run(index: int) -> None:
        # aclosing: a cancelled `async for` leaves its generator open; closing it aborts the request now.
        async with aclosing(streams[index]) as outputs:
            async for output in outputs:
                finals[index] = output

    with engine_errors_as_http():
        async with anyio.create_task_group() as tg:
            for index in range(len(streams)):
                tg.start_soon(run, index)
    return finals
