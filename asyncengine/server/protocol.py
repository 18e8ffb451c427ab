"""The bodies of the OpenAI-compatible API as msgspec Structs.

Requests declare every field they read. A top-level field no Struct declares is ignored, named in the
response's X-Ignored-Fields header and logged, or a 400 with --strict-request-fields (request_fields.py);
OpenAI's fields that have no effect here are declared (typed, in /openapi.json) and listed there as
ignored. Parameters we know but cannot honour with the value given (`suffix`, `best_of` other than `n`)
are a 400 saying so (see `unsupported()`).

Bounds at the edge (docs/server.md, "Limits"): every bound the server enforces on a field is declared on
it as `msgspec.Meta` (the sampling fields with the bounds table, sampling_bounds.py, which SamplingParams
shares; every integer an int64, as the engine's tensors hold them; floats within float32), so msgspec
refuses a value out of range naming the field, and /openapi.json publishes the same bounds. Bounds that come from the configuration (`n` at most
--max-n, token ids within the vocabulary, `max_tokens` within the context) are declared with `limit(...)`:
the server decodes with the Structs `request_bounds.bounded` gives for its configuration. `prompt`, which
OpenAI's clients send in several shapes, is typed so that it nests at most two lists deep: msgspec then stops
at the first level too deep instead of decoding (recursively) whatever a client nests there; the shapes are
checked by hand in serving_completions.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from asyncengine.json_nesting import json_tokens
from asyncengine.interfaces.parsers import DeltaMessage, ToolCall
from asyncengine.sampling_bounds import (
    Int64, LogitBias, MinTokens, NumCompletions, NumLogprobs, NumTokens, Penalty, Probability, RepetitionPenalty,
    Temperature, TokenId, TopK, TopP, TruncatePromptTokens,
)

# -- requests ------------------------------------------------------------------------------------------

_TOO_DEEP = 256  # far below msgspec's recursion limit, far above any request's honest nesting


def too_deep_field(body: bytes) -> str | None:
    """After msgspec raised RecursionError on `body` (a field typed `Any` nested too deep): the
    top-level field that holds the nesting, found by a scan that follows strings and brackets without
    decoding anything; None when the body is not an object holding such a field."""
    depth, key = 0, None
    for match in json_tokens(body):
        token = match.group()
        if token[0] == 0x22:  # a string: at depth 1, followed by ':', it is a top-level key
            if depth == 1 and body[match.end():match.end() + 64].lstrip()[:1] == b":":
                key = token[1:-1].decode("utf-8", "replace")
        elif token in b"[{":
            depth += 1
            if depth > _TOO_DEEP:
                return key
        else:
            depth -= 1
    return None


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# vLLM's `vllm_xargs` values: a string, a number or a list of them (booleans too, which vLLM's schema
# turns into numbers). No nested objects and no null: what extensions read is flat, as in vLLM.
XargScalar = str | int | float | bool
XargValue = XargScalar | list[XargScalar]


# The sampling fields' types are the bounds table's (sampling_bounds.py), which SamplingParams and the wire's
# SamplingOptions share. Token ids, at least one (an empty prompt is refused; an empty string is refused too where its tokens are none).
TokenIds = Annotated[list[TokenId], msgspec.Meta(min_length=1)]
# A completion prompt: a string, a list of strings or token ids (and lists of token ids); see above.
Prompt = str | Annotated[list[str | TokenId | TokenIds], msgspec.Meta(min_length=1)]


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What completions and chat completions share: OpenAI's sampling parameters and vLLM's extras."""

    model: str | None = None
    n: NumCompletions = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # 0 and -1: off
    min_p: Probability | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: MinTokens | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras (docs/server.md, "Fields"): the scheduling priority (--scheduling-policy priority; lower
    # first), a prefix-cache salt (requests with different salts share no cached blocks), keeping the
    # prompt's last N tokens (-1: the last max_model_len), logprob tokens as "token_id:N".
    priority: Int64 = 0
    cache_salt: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    return_tokens_as_token_ids: bool | None = None
    # vLLM's older structured-output fields, read as the matching key of structured_outputs (one of them, and
    # not beside structured_outputs or response_format).
    guided_json: Any = None  # a JSON schema (an object, or its text)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # OpenAI's, accepted without effect here (request_fields.IGNORED_FIELDS, listed in X-Ignored-Fields).
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's per-request arguments for extensions: becomes SamplingParams.extra_args, which logits
    # processors read (validate_params in this process, apply in the workers).
    vllm_xargs: dict[str, XargValue] | None = None
    # Structured outputs (docs/structured_outputs.md): OpenAI's response_format ("text", "json_object",
    # "json_schema") and vLLM's structured_outputs extra body (json, regex, choice, grammar, ...).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # OpenAI's token id (a string, as JSON keys are) -> bias in [-100, 100]; vLLM's extra-body token
    # filters (docs/sampling.md, "Logit bias, allowed tokens and bad words"). Checked by SamplingParams.
    logit_bias: dict[str, LogitBias] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    # Known, not implemented: a request that sets it gets a 400 that says so.
    best_of: NumCompletions | None = None


class CompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    prompt: Prompt  # str | list[str] | list[int] | list[list[int]], checked in serving_completions
    max_tokens: NumTokens | None = 16
    logprobs: NumLogprobs | None = None
    add_special_tokens: bool = True
    echo: bool = False  # the prompt's text before each choice's (serving_completions.py)
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        found = _unsupported_shared(self)
        if self.echo and self.logprobs is not None:
            found.append(("echo", "echo with logprobs is not supported: the prompt's logprobs are not computed here; "
                                  "send echo or logprobs"))
        if self.suffix:
            found.append(("suffix", "suffix is not supported"))
        return found


class ContentPart(msgspec.Struct, kw_only=True):
    # Text parts are read ("text", "input_text", "output_text", "refusal"), and for a multimodal model
    # "image_url" parts ({"url": "data:..."}, or the url itself, as vLLM takes it); others are a 400.
    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: dict[str, Any] | str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    # Messages are taken as clients send them (an assistant message copied back from a response carries
    # fields such as `refusal`; one with tool calls has null or no content); frontend/chat_messages.py
    # makes them what the template reads: role, content, name, tool calls, tool call ids, reasoning.
    role: str
    content: str | list[ContentPart | str] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None  # vLLM's current name; `reasoning_content` its earlier one: either is read
    reasoning_content: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: NumTokens | None = None
    max_completion_tokens: NumTokens | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    # With a forced tool_choice, false asks for exactly one call; otherwise without effect (listed as ignored).
    parallel_tool_calls: bool | None = None
    # vLLM's: unset means true, or false with continue_final_message (both true is a 400).
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False  # continue the last (assistant) message instead of starting one
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: a Jinja chat template for this request (needs --trust-request-chat-template), and documents
    # for a RAG template (the template's `documents` variable).
    chat_template: str | None = None
    documents: list[dict[str, Any]] | None = None
    # OpenAI's chat fields without effect here (request_fields.IGNORED_FIELDS): the legacy function calling
    # (vLLM ignores it too: send tools and tool_choice), audio and reasoning controls, hosted tools.
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    verbosity: str | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        return _unsupported_shared(self)


def _unsupported_shared(request: SamplingFields) -> list[tuple[str, str]]:
    found = []
    if request.best_of is not None and request.best_of != request.n:
        found.append(("best_of", "best_of other than n is not supported"))
    return found


class IOProcessRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/io_process: `data` is the IO processor's own input (any JSON); the sampling fields
    apply to every prompt its pre_process builds."""

    data: Any
    max_tokens: NumTokens | None = 16
    add_special_tokens: bool = True

    def unsupported(self) -> list[tuple[str, str]]:
        found = _unsupported_shared(self)
        if self.stream:
            found.append(("stream", "stream is not supported by /v1/io_process: post_process needs every output"))
        return found


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    add_generation_prompt: bool | None = None  # as in ChatCompletionRequest
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # as in ChatCompletionRequest (--trust-request-chat-template)
    return_token_strs: bool = False  # vLLM's: also each token's string (the tokenizer's own piece)


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[TokenId]


# -- responses -----------------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details (vLLM's)


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob] | None = None


class ResponseMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None  # vLLM's current name for the reasoning text
    reasoning_content: str | None = None  # the same text under its earlier name, for one more release
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    object: str = "chat.completion"
    usage: Usage | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None


class IOProcessResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    plugin: str  # the IO processor that made `data` (--io-processor-plugin)
    data: Any  # what its post_process returned
    object: str = "io_process"
    usage: Usage | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "asyncengine"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (server/serving_lora.py)


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class RenderedRequest(msgspec.Struct, kw_only=True, omit_defaults=False):
    """POST /v1/chat/completions/render and /v1/completions/render (one per prompt): the request as the
    engine would take it, rendered and tokenized but not generated; vLLM's GenerateRequest shape."""

    request_id: str
    token_ids: list[int]
    sampling_params: dict[str, Any]  # with the model's defaults and the context-length bound filled in
    model: str | None = None
    features: dict[str, Any] | None = None  # multimodal placeholders in vLLM; none here (text only)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
