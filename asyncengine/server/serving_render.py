"""POST /v1/chat/completions/render and /v1/completions/render (vLLM's): a request rendered through the
chat template, tokenized and validated as the engine would take it, and not run.

The answer is vLLM's GenerateRequest shape: `request_id`, `token_ids`, `sampling_params` (with the
model's generation_config defaults and the context-length bound on max_tokens filled in), `model`,
`stream`, `stream_options`, `cache_salt` and `priority` as sent, and `features` and `kv_transfer_params` (None
here: text only). The chat route answers one, the completion route a list (one per
prompt). A request the engine would refuse is refused here with the same 400. Both routes need no
engine: the render server (render_server.py) answers them as the full server does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncengine.errors import RequestError
from asyncengine.sampling_params import SamplingParams
from asyncengine.server.common import ServingContext, chat_prompt_text, check_supported, new_id, sampling_params
from asyncengine.server.common import tokenize_prompt
from asyncengine.server.errors import from_engine_error
from asyncengine.server.protocol import ChatCompletionRequest, CompletionRequest, RenderedRequest
from asyncengine.server.serving_chat import chat_parts
from asyncengine.server.serving_completions import prompts_of
from asyncengine.server.serving_lora import resolve_model

if TYPE_CHECKING:
    from asyncengine.frontend.engine_client import EngineClient

# SamplingParams' fields, as vLLM's render answer lists them.
_SAMPLING_FIELDS = SamplingParams.__struct_fields__


async def render_chat_request(context: ServingContext, request: ChatCompletionRequest,
                              header_id: str | None) -> RenderedRequest:
    parts = await chat_parts(context, request)
    engine = parts.context.engine
    text = await chat_prompt_text(engine, parts.messages, **parts.chat_options)
    token_ids = await tokenize_prompt(engine, text, add_special_tokens=bool(request.add_special_tokens))
    processed = _validated(engine, {"prompt": text, "prompt_token_ids": token_ids}, parts.params,
                           new_id("chatcmpl", header_id), parts.lora_request, request)
    return _rendered(processed, request)


async def render_completion_request(context: ServingContext, request: CompletionRequest,
                                    header_id: str | None) -> list[RenderedRequest]:
    lora_request = await resolve_model(context, request.model)
    check_supported(request)
    engine = context.engine
    response_id = new_id("cmpl", header_id)
    prompts = prompts_of(request)
    rendered = []
    for index, prompt in enumerate(prompts):
        params = sampling_params(request, max_tokens=request.max_tokens, logprobs=request.logprobs)
        if isinstance(prompt, str):
            ids = await tokenize_prompt(engine, prompt, add_special_tokens=request.add_special_tokens)
            engine_prompt: dict[str, Any] = {"prompt": prompt, "prompt_token_ids": ids}
        else:
            engine_prompt = {"prompt_token_ids": prompt}
        request_id = response_id if len(prompts) == 1 else f"{response_id}-{index}"
        rendered.append(_rendered(_validated(engine, engine_prompt, params, request_id, lora_request, request),
                                  request))
    return rendered


def _validated(engine: EngineClient, prompt: dict[str, Any], params: Any, request_id: str, lora_request: Any,
               request: ChatCompletionRequest | CompletionRequest) -> Any:
    """The engine's checks of the request (the ProcessedRequest), without queueing it."""
    priority = request.priority
    if request.cache_salt is not None:
        prompt = {**prompt, "cache_salt": request.cache_salt}
    try:
        return engine.process_request(prompt, params, request_id, lora_request, priority)
    except RequestError as error:
        raise from_engine_error(error) from error


def _rendered(processed: Any, request: ChatCompletionRequest | CompletionRequest) -> RenderedRequest:
    params = processed.params
    values = {name: getattr(params, name) for name in _SAMPLING_FIELDS}
    values["max_tokens"] = processed.children[0].sampling.max_tokens  # the bound the engine would run with
    return RenderedRequest(request_id=processed.request_id, token_ids=list(processed.prompt_token_ids),
                           sampling_params=values, model=request.model, stream=request.stream,
                           stream_options=request.stream_options if request.stream else None,
                           cache_salt=request.cache_salt, priority=request.priority)

