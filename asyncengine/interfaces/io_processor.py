"""IOProcessor: the interface of IO-processor plugins (entry-point group asyncengine.io_processor_plugins).

Read in the frontend. vLLM's contract, whole: `IOProcessor[IOProcessorInput, IOProcessorOutput]`, built as
`cls(vllm_config, renderer)` (or `cls(vllm_config)` when its constructor takes one argument), and per request,
in vLLM's order:

1. `parse_data(data)` (vLLM's newer name; or `parse_request(request)`, its older one, given the whole request)
   turns the request's `data` into the plugin's input; without either, `pre_process` gets the request itself
   (this engine's first form of the interface);
2. `pre_process(prompt, request_id=..., **kwargs)` returns the prompts;
3. `merge_pooling_params(params)` (on /pooling; `merge_sampling_params` on /v1/io_process; or vLLM's older
   `validate_or_generate_params(params)`) returns the parameters every prompt runs with;
4. each prompt runs (pooled on /pooling, generated on /v1/io_process), then
   `post_process(outputs, request_id=..., **kwargs)` gets the outputs in prompt order;
5. `output_to_response(plugin_output)` (vLLM's older, optional) wraps the result; an `IOProcessorResponse` is
   unwrapped to its `data`.

The response's `data` is whatever post_process returned: a pydantic model (or a list or dict of them) is
converted through its `model_dump(mode="json")`, anything else must be msgspec-encodable; what is not is a 500
naming the plugin and the method. Every method may be a plain one (run in a worker thread; the calls of one
request share one contextvars context, as they would on vLLM's one thread) or an `async def`
(`pre_process_async` and `post_process_async` are vLLM's async forms, used when a subclass defines them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

IOProcessorInput = TypeVar("IOProcessorInput")
IOProcessorOutput = TypeVar("IOProcessorOutput")


class Renderer:
    """What vLLM's IO processors are built with as `renderer` (vLLM's BaseRenderer): the frontend's tokenizer
    (None with skip_tokenizer_init) and the model's config."""

    def __init__(self, tokenizer: Any, model_config: Any) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("the engine runs with skip_tokenizer_init: it has no tokenizer")
        return self.tokenizer


@dataclass
class IOProcessorResponse:
    """vLLM's wrapper of an IO processor's answer (what its older `output_to_response` returns)."""

    data: Any = None
    request_id: str | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))


class IOProcessor(Generic[IOProcessorInput, IOProcessorOutput]):
    """Subclass it and override `pre_process` and `post_process` (and, for vLLM's form, `parse_data` and
    `merge_pooling_params`). Built once, when the server starts."""

    def __init__(self, vllm_config: Any = None, renderer: Any = None, *args: Any, **kwargs: Any) -> None:
        self.vllm_config = vllm_config
        self.engine_config = vllm_config  # this engine's name for it
        self.renderer = renderer

    def parse_data(self, data: Any) -> IOProcessorInput:
        """vLLM's: the request's `data` as the plugin's input. Not overridden: the request is passed on as it is."""
        raise NotImplementedError

    def merge_pooling_params(self, params: Any = None) -> Any:
        """vLLM's: the PoolingParams every prompt of the request is pooled with. The server always passes the
        request's (never None), and this default keeps them."""
        return params

    def merge_sampling_params(self, params: Any = None) -> Any:
        """vLLM's: the SamplingParams every prompt of the request is generated with. The server always passes the
        request's (never None), and this default keeps them."""
        return params

    def pre_process(self, prompt: Any, request_id: str | None = None, **kwargs: Any) -> Any:
        """The prompts for `prompt` (parse_data's result, or the request): a prompt or a list of them, each a
        string, a list of token ids, `{"prompt": str}` or `{"prompt_token_ids": [...]}` (vLLM's TokensPrompt).
        Raise `RequestError` or `ValueError` to refuse bad input (HTTP 400); any other exception is a 500
        naming the plugin."""
        raise NotImplementedError

    def post_process(self, model_output: Any, request_id: str | None = None, **kwargs: Any) -> IOProcessorOutput:
        """The response's `data` from the outputs, one per prompt in pre_process's order (RequestOutput on
        /v1/io_process, PoolingRequestOutput on /pooling)."""
        raise NotImplementedError


# vLLM's prompt shapes (vllm.inputs), as the dicts they are.
PromptType = str | dict[str, Any] | list[int]


class TokensPrompt(dict[str, Any]):
    """vLLM's TokensPrompt: `TokensPrompt(prompt_token_ids=[...])`, a dict as vLLM's TypedDict is."""


class TextPrompt(dict[str, Any]):
    """vLLM's TextPrompt: `TextPrompt(prompt="...")`, a dict as vLLM's TypedDict is."""


__all__ = ["IOProcessor", "IOProcessorInput", "IOProcessorOutput", "IOProcessorResponse", "PromptType", "Renderer",
           "TextPrompt", "TokensPrompt"]
