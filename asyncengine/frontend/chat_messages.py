"""Chat messages as clients send them, made into the conversation a chat template renders, as vLLM makes it.

Clients send what the OpenAI API allows: an assistant message that made tool calls has `content` null or
no `content` at all; a `tool` message answers a call by `tool_call_id`; content may be a string or a
list of parts (`{"type": "text", "text": ...}`, and the `input_text`, `output_text` and `refusal` parts
agent frameworks send back); any message may carry a `name`. A template written for text reads
`message['content']` as a string and fails on a missing or null one ("'dict object' has no attribute
'content'"), so each message is rewritten in the shape the template expects (its *content format*):

- "string" (templates that print `message['content']`): content is one string: the text parts joined with
  a newline, and "" for null or missing content;
- "openai" (templates that loop over `message['content']`, such as multimodal ones): content is a list of
  `{"type": "text", "text": ...}` parts, and [] for null or missing content; a `tool` message's text parts
  are still joined into one string, which is what tool-message templates print.

"auto" (the default, vLLM's `--chat-template-content-format auto`) detects the format from the template:
"openai" when it has a `for` loop over a message's content, else "string".

Besides content: an assistant message's `tool_calls` are kept (an empty list is dropped, so templates take
their plain path) with each call's `function.arguments`, a JSON string on the wire, parsed to the object
templates expect (`tool_call.function.arguments | tojson`); `tool_call_id` on tool messages, `name` where a
string, and an assistant's `reasoning` (also given as `reasoning_content`, its older name) are kept.
Arguments that are not valid JSON stay the string the model wrote (vLLM replaces them with {}; the model
should see what it said), and missing ones become {}.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from asyncengine.config.engine import CHAT_TEMPLATE_CONTENT_FORMATS
from asyncengine.errors import RequestError

# Part types whose text a text model reads: the key holding the text, per type.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def conversation_for_template(messages: list[dict[str, Any]], template: str, content_format: str = "auto", *,
                              image_placeholder: str | None = None) -> list[dict[str, Any]]:
    """`messages` (checked: a list of objects with a string `role`) as `template` takes them; new dicts, the
    caller's messages are not changed. Content the server cannot read is a RequestError naming the part.
    `image_placeholder`: for a multimodal model, the text that stands for an image; its `{"type": "image"}`
    parts (chat_images.py made them from the request's image parts) reach an "openai" template as they are
    and a "string" one as that text. None: image parts are refused (the model takes no images)."""
    resolved = detect_content_format(template) if content_format == "auto" else content_format
    if resolved not in ("string", "openai"):
        raise RequestError(f"chat_template_content_format must be one of {', '.join(CHAT_TEMPLATE_CONTENT_FORMATS)}, got "
                           f"{content_format!r}", field="chat_template_content_format")
    return [_message(index, message, resolved, image_placeholder) for index, message in enumerate(messages)]


def _message(index: int, message: dict[str, Any], content_format: str, image_placeholder: str | None) -> dict[str, Any]:
    role = message["role"]
    parts = _parts(index, message.get("content"), image_placeholder)
    content: str | list[dict[str, str]]
    if content_format == "string" or role == "tool":
        content = "\n".join(part["text"] if part["type"] == "text" else str(image_placeholder) for part in parts)
    else:
        content = parts
    result: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls:
            result["tool_calls"] = _tool_calls(index, tool_calls)
        reasoning = next((message[key] for key in ("reasoning", "reasoning_content")
                          if isinstance(message.get(key), str)), None)
        if reasoning is not None:
            result["reasoning"] = result["reasoning_content"] = reasoning
    elif role == "tool" and message.get("tool_call_id") is not None:
        result["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        result["name"] = message["name"]
    return result


# Image parts as clients send them: what a model that takes no images refuses.
_IMAGE_PARTS = ("image_url", "image_pil", "image_embeds", "input_image", "image")


def _parts(index: int, content: Any, image_placeholder: str | None) -> list[dict[str, str]]:
    """A message's content as `{"type": "text", "text": ...}` and `{"type": "image"}` parts, in order: from a
    string, a list of parts, or nothing (null, absent)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"messages[{index}].content must be a string, a list of content parts or null, got "
                           f"{type(content).__name__}", field=f"messages[{index}].content")
    parts = []
    for part_index, part in enumerate(content):
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        where = f"messages[{index}].content[{part_index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image" and image_placeholder is not None:
            parts.append({"type": "image"})
            continue
        if kind in _IMAGE_PARTS:
            raise RequestError(f"{where}: content part type {kind!r} is not supported: this model takes no images "
                               "(it is not multimodal)", field=f"{where}.type", code="unsupported_parameter")
        if kind not in _TEXT_PARTS:
            raise RequestError(f"{where}: content part type {kind!r} is not supported: this server reads text parts "
                               f"({', '.join(_TEXT_PARTS)}) and, for a multimodal model, image_url parts",
                               field=f"{where}.type", code="unsupported_parameter")
        text = part.get(_TEXT_PARTS[kind])
        if text is None:  # an empty part, as vLLM skips it
            continue
        if not isinstance(text, str):
            raise RequestError(f"{where}.{_TEXT_PARTS[kind]} must be a string", field=f"{where}.{_TEXT_PARTS[kind]}")
        parts.append({"type": "text", "text": text})
    return parts


def _tool_calls(index: int, tool_calls: Any) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, list):
        raise RequestError(f"messages[{index}].tool_calls must be a list", field=f"messages[{index}].tool_calls")
    calls = []
    for call_index, call in enumerate(tool_calls):
        where = f"messages[{index}].tool_calls[{call_index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{where} must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": "
                               "..., \"arguments\": \"{...}\"}}}", field=f"{where}.function")
        calls.append({**call, "function": {**function, "arguments": _arguments(function.get("arguments"))}})
    return calls


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, (dict, list)):
        return arguments
    if isinstance(arguments, str) and arguments.strip():
        try:
            parsed = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):  # not JSON, or nested past what the parser follows
            return arguments
        return parsed if isinstance(parsed, (dict, list)) and _depth(parsed) <= MAX_ARGUMENTS_DEPTH else arguments
    return {}


# Tool-call arguments nested deeper than this reach the template as the string they came as: rendering an
# object hundreds of levels deep exhausts Python's stack (the body's own nesting is bounded before this).
MAX_ARGUMENTS_DEPTH = 64


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in `value` (a scalar: 0), walked without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, level = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        pending.extend((child, level + 1) for child in children)
    return deepest


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """"openai" when `template` loops over a message's content (`{% for part in message['content'] %}`,
    through `set` aliases of `messages` and filters or slices of it), else "string"; a template that does
    not parse is "string" (rendering it reports its error)."""
    import jinja2
    import jinja2.nodes as nodes

    try:
        tree = _template_environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"

    def source(node: nodes.Node | None) -> nodes.Node | None:
        # `messages | selectattr(...)`, `messages is ...`, `messages[1:]` read the same sequence.
        while isinstance(node, (nodes.Filter, nodes.Test)) or (
                isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
            node = node.node
        return node

    def is_name(node: nodes.Node | None, names: set[str]) -> bool:
        node = source(node)
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names

    def is_content_of(node: nodes.Node | None, names: set[str]) -> bool:
        node = source(node)
        if isinstance(node, nodes.Getattr):
            return node.attr == "content" and is_name(node.node, names)
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content" and is_name(node.node, names)
        return False

    sequences = {"messages"}
    grown = True
    while grown:  # names `set` from messages (or from such a name), until no new one appears
        grown = False
        for assign in tree.find_all(nodes.Assign):
            if isinstance(assign.target, nodes.Name) and assign.target.name not in sequences \
                    and is_name(assign.node, sequences):
                sequences.add(assign.target.name)
                grown = True
    loops = list(tree.find_all(nodes.For))
    message_names = {loop.target.name for loop in loops
                     if isinstance(loop.target, nodes.Name) and is_name(loop.iter, sequences)}
    return "openai" if any(is_content_of(loop.iter, message_names) for loop in loops) else "string"


@lru_cache(maxsize=1)
def _template_environment() -> Any:
    """An environment that parses what chat templates use: loop controls and transformers' `{% generation %}`."""
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            from jinja2 import nodes

            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                         extensions=[GenerationBlock, loopcontrols])


__all__ = ["conversation_for_template", "detect_content_format"]
