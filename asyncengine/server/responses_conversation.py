"""A Responses request as the chat request it amounts to: the same template, parsers, tool_choice and
structured output as /v1/chat/completions (serving_chat.py), over a different shape.

- the conversation: `instructions` (a system message), then the stored conversation of
  `previous_response_id` (its input and output, without its instructions, which OpenAI does not carry
  over), then `input`. Input items become chat messages as vLLM makes them: a message item is a message
  (`developer` is a system message, which every template knows); a `reasoning` item, the `message` and
  the `function_call`s after it are one assistant turn (its `reasoning`, `content` and `tool_calls`); a
  `function_call_output` is a `tool` message answering its `call_id`.
- `tools` (flat function tools) become chat's `{"type": "function", "function": {...}}`; `tool_choice`
  `{"type": "function", "name": N}` becomes chat's named function; `text.format` becomes
  `response_format`; `max_output_tokens` is `max_completion_tokens`; `reasoning.effort` reaches the chat
  template as `reasoning_effort` (vLLM's); `include` ["message.output_text.logprobs"] asks for logprobs.

What cannot be converted is a 400 naming the Responses field (`input[3].type`, `tools[0].type`); an
error the chat machinery raises is renamed to the Responses field it came from (`responses_error`).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from asyncengine.server.errors import ApiError, bad_request
from asyncengine.server.protocol import ChatCompletionRequest, ChatMessage, Tool
from asyncengine.server.protocol_responses import (
    FunctionCallItem, InputContentPart, InputItem, OutputItem, OutputMessage, ReasoningItem, ResponsesRequest,
)

# The part types whose text a message item carries (the rest, images, files and audio, are refused).
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# `include` values OpenAI defines. Logprobs are implemented; the others ask for outputs this server never
# makes (hosted tools, images, encrypted reasoning), so asking for them changes nothing.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
KNOWN_INCLUDES = frozenset({INCLUDE_LOGPROBS, "reasoning.encrypted_content", "file_search_call.results",
                            "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                            "computer_call_output.output.image_url", "code_interpreter_call.outputs"})


def unsupported(message: str, param: str) -> ApiError:
    return bad_request(message, param=param, code="unsupported_parameter")


def check_request_fields(request: ResponsesRequest) -> None:
    """The fields this server knows and refuses, or whose value it cannot take."""
    if request.prompt is not None:
        raise unsupported("prompt (a stored prompt template) is not supported: send the text as input", "prompt")
    if request.conversation is not None:
        raise unsupported("conversation (OpenAI-hosted conversation state) is not supported: continue a stored "
                          "response with previous_response_id", "conversation")
    if request.truncation not in (None, "auto", "disabled"):
        raise bad_request(f"truncation must be 'auto' or 'disabled', got {request.truncation!r}", param="truncation",
                          code="invalid_value")
    for value in request.include or []:
        if value not in KNOWN_INCLUDES:
            raise bad_request(f"include value {value!r} is not one of {', '.join(sorted(KNOWN_INCLUDES))}",
                              param="include", code="invalid_value")


# -- input items -> chat messages ----------------------------------------------------------------------


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """`input` as chat messages (dicts as clients send them to /v1/chat/completions)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        _add_item(messages, item, f"input[{index}]")
    return messages


def _add_item(messages: list[dict[str, Any]], item: InputItem, where: str) -> None:
    kind = item.type or "message"
    last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if kind == "message":
        role = _ROLES.get(item.role or "")
        if role is None:
            raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got {item.role!r}",
                              param=f"{where}.role", code="invalid_value" if item.role else "missing_parameter")
        content = item.content if isinstance(item.content, str) else _texts(item.content, f"{where}.content")
        if role == "assistant" and last is not None and "content" not in last and "tool_calls" not in last:
            last["content"] = content  # the answer after this turn's reasoning
        else:
            messages.append({"role": role, "content": content})
    elif kind == "function_call":
        call = {"id": _required(item.call_id, f"{where}.call_id"), "type": "function",
                "function": {"name": _required(item.name, f"{where}.name"), "arguments": item.arguments or "{}"}}
        if last is not None:
            last.setdefault("tool_calls", []).append(call)  # the calls of one turn, in order
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.output if isinstance(item.output, str) else _texts(
            _required(item.output, f"{where}.output"), f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": _required(item.call_id, f"{where}.call_id"),
                         "content": output})
    elif kind == "reasoning":
        if item.encrypted_content is not None:
            raise unsupported(f"{where}.encrypted_content: this server writes no encrypted reasoning and reads none; "
                              "send the reasoning's content", f"{where}.encrypted_content")
        parts = item.content if isinstance(item.content, list) else item.summary or []
        reasoning = "\n".join(part.text for part in parts if part.text)
        messages.append({"role": "assistant", "reasoning": reasoning})
    elif kind == "item_reference":
        raise unsupported(f"{where}: item_reference is not supported: send the item itself, or continue a stored "
                          "response with previous_response_id", f"{where}.type")
    else:
        raise unsupported(f"{where}.type {kind!r} is not supported: this server reads message, function_call, "
                          "function_call_output and reasoning items", f"{where}.type")


def _required(value: Any, where: str) -> Any:
    if value is None:
        raise bad_request(f"missing required parameter {where!r}", param=where, code="missing_parameter")
    return value


def _texts(parts: list[InputContentPart] | None, where: str) -> list[dict[str, str]]:
    """Content parts as chat's text parts; a part that is not text is refused by name."""
    texts = []
    for index, part in enumerate(parts or []):
        key = _TEXT_PARTS.get(part.type)
        if key is None:
            raise unsupported(f"{where}[{index}]: content part type {part.type!r} is not supported: this server "
                              f"reads text parts ({', '.join(_TEXT_PARTS)})", f"{where}[{index}].type")
        text = getattr(part, key)
        if text is not None:
            texts.append({"type": "text", "text": text})
    return texts


def output_messages(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages of the assistant's turn (for a continuation)."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if isinstance(item, ReasoningItem):
            messages.append({"role": "assistant", "reasoning": "\n".join(part.text for part in item.content)})
            continue
        last = messages[-1] if messages else None
        if last is None:
            last = {"role": "assistant"}
            messages.append(last)
        if isinstance(item, OutputMessage):
            last["content"] = "".join(part.text for part in item.content)
        elif isinstance(item, FunctionCallItem):
            last.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": item.arguments}})
    return messages


# -- the chat request ----------------------------------------------------------------------------------


def chat_request(request: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion request `request` amounts to, over the conversation `messages`."""
    template_kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning is not None and request.reasoning.effort is not None:
        template_kwargs.setdefault("reasoning_effort", request.reasoning.effort)
    logprobs = INCLUDE_LOGPROBS in (request.include or [])
    return ChatCompletionRequest(
        messages=[msgspec.convert(message, ChatMessage) for message in messages],
        model=request.model, stream=request.stream, max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
        repetition_penalty=request.repetition_penalty, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, seed=request.seed, stop=request.stop,
        ignore_eos=request.ignore_eos, skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output, logit_bias=request.logit_bias,
        structured_outputs=request.structured_outputs, vllm_xargs=request.vllm_xargs,
        response_format=_response_format(request), tools=_tools(request), tool_choice=_tool_choice(request),
        parallel_tool_calls=request.parallel_tool_calls, logprobs=logprobs,
        top_logprobs=request.top_logprobs if logprobs else None, chat_template_kwargs=template_kwargs or None,
        user=request.user,
    )


def _tools(request: ResponsesRequest) -> list[Tool] | None:
    if not request.tools:
        return None
    tools = []
    for index, tool in enumerate(request.tools):
        if tool.type != "function":
            raise unsupported(f"tools[{index}].type {tool.type!r} is not supported: this server runs function tools "
                              "(OpenAI's hosted tools run on OpenAI's servers)", f"tools[{index}].type")
        definition = {"name": _required(tool.name, f"tools[{index}].name"), "description": tool.description,
                      "parameters": tool.parameters, "strict": tool.strict}
        tools.append(msgspec.convert({"type": "function", "function": definition}, Tool))
    return tools


def _tool_choice(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if not isinstance(choice, dict):
        return choice  # None, "none", "auto", "required" (another string: a 400 from tool_choice.py)
    kind = choice.get("type")
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"name\": ...}}; "
                      f"type {kind!r} is not supported here", "tool_choice")


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    text_format = request.text.format if request.text is not None else None
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.type == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": text_format.name, "schema": text_format.schema,
                                                       "strict": text_format.strict}}
    raise bad_request(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {text_format.type!r}",
                      param="text.format.type", code="invalid_value")


# -- errors of the chat machinery, in the Responses' names ----------------------------------------------

# (chat's parameter, the Responses parameter), longest first: a prefix is renamed with what follows it.
_RENAMED = [("response_format.json_schema.schema", "text.format.schema"), ("response_format.json_schema", "text.format"),
            ("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"),
            ("max_tokens", "max_output_tokens"), ("top_logprobs", "top_logprobs"), ("logprobs", "include"),
            ("messages", "input"), ("prompt", "input")]
_TOOL_FUNCTION = re.compile(r"^tools\[(\d+)\]\.function\b")


def responses_param(param: str | None, request: ResponsesRequest) -> str | None:
    if param is None:
        return None
    if param.startswith("structured_outputs.json") and request.structured_outputs is None:
        return "text.format.schema"  # the constraint came from text.format
    if _TOOL_FUNCTION.match(param):
        return _TOOL_FUNCTION.sub(r"tools[\1]", param)
    for chat_name, name in _RENAMED:
        if param == chat_name or param.startswith((chat_name + ".", chat_name + "[")):
            return name if param.startswith("messages") or param == "prompt" else name + param[len(chat_name):]
    return param


def responses_error(error: ApiError, request: ResponsesRequest) -> ApiError:
    """`error` (raised by the chat machinery) with the Responses field it concerns: its `param`, and the
    field's name where the message says it."""
    param = responses_param(error.param, request)
    if param == error.param:
        return error
    message = error.message
    if error.param:
        message = re.sub(rf"(?<![\w.]){re.escape(error.param)}(?![\w])", param or "", message)
    return ApiError(error.status, message, type=error.type, param=param, code=error.code, headers=error.headers)
