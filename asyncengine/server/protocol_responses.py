"""The bodies of OpenAI's Responses API (`/v1/responses`) as msgspec Structs: the request, the response
object, its output items and the server-sent events of a stream.

The request forbids unknown top-level fields, as the chat request does. The fields OpenAI documents and
this server does not act on are declared, so that a client sending them is answered (docs/server.md,
"The Responses API", lists which are ignored and which are refused). Input items, content parts and
tools do not forbid unknown fields: clients send output items back as they received them, with fields
this server does not read (`annotations`, `logprobs`, `phase`, ...).

The output and event Structs are tagged by their `type`, as OpenAI's are, so that the OpenAPI document
(server/openapi.py) says which shape each `type` has. Field names and event types are OpenAI's (the
official `openai` package's `openai/types/responses`).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from asyncengine.sampling_params import _FLOAT32_TINY as FLOAT32_TINY  # the smallest normal float32
from asyncengine.sampling_params import FLOAT32_MAX, INT64_MAX
from asyncengine.server.protocol import Int64, NumLogprobs, NumTokens, Penalty, Probability, XargValue

# The most items `input` may hold. The body's byte limit bounds it too, but a body of empty items within
# that limit would still be a list of hundreds of thousands of messages for the chat template to render.
MAX_INPUT_ITEMS = 10_000
# OpenAI's bounds on `metadata`: at most 16 pairs, keys of at most 64 characters, values of at most 512.
MAX_METADATA_PAIRS = 16
MetadataKey = Annotated[str, msgspec.Meta(max_length=64)]
MetadataValue = Annotated[str, msgspec.Meta(max_length=512)]


# -- the request ---------------------------------------------------------------------------------------


class InputContentPart(msgspec.Struct, kw_only=True):
    """A part of an input message's content (`input_text`, or `output_text` and `refusal` from an
    assistant message sent back), of a function call's output, or of a reasoning item (`reasoning_text`,
    `summary_text`). Images, files and audio are refused by name (the models served read text)."""

    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """One item of `input`, any kind: a message (`type` "message", or none, with `role` and `content`),
    a `function_call` the model made (`call_id`, `name`, `arguments`), a `function_call_output` (its
    `call_id` and `output`), or a `reasoning` item (`content` or `summary`). The conversion to chat
    messages (server/responses_conversation.py) checks each kind's fields and names what is wrong."""

    type: str | None = None
    role: str | None = None
    content: str | list[InputContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContentPart] | None = None
    summary: list[InputContentPart] | None = None
    encrypted_content: str | None = None


class ResponsesTool(msgspec.Struct, kw_only=True):
    """A tool: a function (`type` "function", flat: `name`, `description`, `parameters`, `strict`). OpenAI's
    hosted tools (web_search, file_search, code_interpreter, mcp, ...) are refused by type."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`text.format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name",
    "schema", "description", "strict"} (flat, unlike chat's response_format)."""

    type: str = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, ignored (docs/server.md)


class ReasoningConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: str | None = None  # given to the chat template as `reasoning_effort`, as vLLM does
    summary: str | None = None  # accepted, ignored: no summaries are written
    generate_summary: str | None = None  # its older name, the same


class ResponsesStreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None  # accepted, ignored: no obfuscation padding is sent


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    input: str | Annotated[list[InputItem], msgspec.Meta(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: NumTokens | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=FLOAT32_MAX)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_logprobs: NumLogprobs | None = None
    include: list[str] | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    background: bool = False
    metadata: Annotated[dict[MetadataKey, MetadataValue], msgspec.Meta(max_length=MAX_METADATA_PAIRS)] | None = None
    previous_response_id: str | None = None
    # Accepted, with no effect here (docs/server.md).
    truncation: str | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)] | None = None
    # Known and refused when set: a stored prompt template, a conversation object (OpenAI-hosted state).
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    # vLLM's extras on its Responses request (sampling and structured output as in chat completions).
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)] | None = None  # 0 and -1: off
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(ge=FLOAT32_TINY, le=FLOAT32_MAX)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]] | None = None
    structured_outputs: dict[str, Any] | None = None
    vllm_xargs: dict[str, XargValue] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# -- the response object -------------------------------------------------------------------------------


class ResponsesTopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class Logprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ResponsesTopLogprob] = msgspec.field(default_factory=list)


class OutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)  # always empty: no citations here
    logprobs: list[Logprob] = msgspec.field(default_factory=list)  # with include ["message.output_text.logprobs"]


class ReasoningText(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class OutputMessage(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: str  # "in_progress", "completed", "incomplete"
    content: list[OutputText]
    role: str = "assistant"


class ReasoningItem(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    status: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)  # always empty: no summaries are written
    encrypted_content: str | None = None


class FunctionCallItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str  # what the function_call_output that answers it names
    name: str
    arguments: str  # the arguments as a JSON text, as the model wrote them
    status: str


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0  # the prompt's tokens found in the prefix cache


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0  # not counted here (docs/server.md)


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class ResponseError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str  # "max_output_tokens"


class ResponsesResponse(msgspec.Struct, kw_only=True):
    """OpenAI's Response object: what POST /v1/responses answers (and, stored, GET /v1/responses/{id})."""

    id: str
    created_at: int
    model: str
    status: str  # "queued", "in_progress", "completed", "incomplete", "cancelled", "failed"
    output: list[OutputItem]
    object: str = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    store: bool = True
    background: bool = False
    completed_at: int | None = None


# -- the events of a stream ------------------------------------------------------------------------------
# Each `event: TYPE` / `data: {...}` pair; `sequence_number` counts the events of the stream from 0.


class StreamEvent(msgspec.Struct, kw_only=True, tag_field="type"):
    sequence_number: int = 0  # set as the event is sent


class _ResponseEvent(StreamEvent):
    """An event about the whole response: its object as it stands."""

    response: ResponsesResponse


class ResponseCreatedEvent(_ResponseEvent, tag="response.created"):
    pass


class ResponseInProgressEvent(_ResponseEvent, tag="response.in_progress"):
    pass


class ResponseCompletedEvent(_ResponseEvent, tag="response.completed"):
    pass


class ResponseIncompleteEvent(_ResponseEvent, tag="response.incomplete"):
    pass


class ResponseFailedEvent(_ResponseEvent, tag="response.failed"):
    pass


class OutputItemAddedEvent(StreamEvent, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDoneEvent(StreamEvent, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class _ItemEvent(StreamEvent):
    """An event about one output item's text: the item, by id and by place in `output`."""

    item_id: str
    output_index: int


class _PartEvent(_ItemEvent):
    """An event about one content part of an item (there is one per item here: index 0)."""

    content_index: int


class ContentPartAddedEvent(_PartEvent, tag="response.content_part.added"):
    part: OutputText | ReasoningText


class ContentPartDoneEvent(_PartEvent, tag="response.content_part.done"):
    part: OutputText | ReasoningText


class OutputTextDeltaEvent(_PartEvent, tag="response.output_text.delta"):
    delta: str
    logprobs: list[Logprob] = msgspec.field(default_factory=list)


class OutputTextDoneEvent(_PartEvent, tag="response.output_text.done"):
    text: str
    logprobs: list[Logprob] = msgspec.field(default_factory=list)


class ReasoningTextDeltaEvent(_PartEvent, tag="response.reasoning_text.delta"):
    delta: str


class ReasoningTextDoneEvent(_PartEvent, tag="response.reasoning_text.done"):
    text: str


class FunctionCallArgumentsDeltaEvent(_ItemEvent, tag="response.function_call_arguments.delta"):
    delta: str


class FunctionCallArgumentsDoneEvent(_ItemEvent, tag="response.function_call_arguments.done"):
    name: str
    arguments: str


class ErrorEvent(StreamEvent, tag="error"):
    """A failure after the stream began (the engine died, a worker refused the request): then
    `response.failed` ends the stream."""

    message: str
    code: str | None = None
    param: str | None = None


ResponseStreamEvent = (
    ResponseCreatedEvent | ResponseInProgressEvent | ResponseCompletedEvent | ResponseIncompleteEvent
    | ResponseFailedEvent | OutputItemAddedEvent | OutputItemDoneEvent | ContentPartAddedEvent
    | ContentPartDoneEvent | OutputTextDeltaEvent | OutputTextDoneEvent | ReasoningTextDeltaEvent
    | ReasoningTextDoneEvent | FunctionCallArgumentsDeltaEvent | FunctionCallArgumentsDoneEvent | ErrorEvent
)
