"""Chat messages as clients send them, shaped for the chat template as vLLM shapes them (frontend/chat_messages.py):
null or absent content beside tool calls, content parts on every role, tool messages, names, reasoning, and the
template's content format ("string" or "openai") detected from the template. Pure logic, no engine."""

from __future__ import annotations

import pytest

from asyncengine.errors import RequestError
from asyncengine.frontend.chat_messages import conversation_for_template, detect_content_format
from support.tiny_tokenizer import CHAT_TEMPLATE

# SmolLM2's template (the default model's): it prints message['content'] and knows nothing of tools.
STRING_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                   "'<|im_end|>' + '\n'}}{% endfor %}")
# A multimodal-style template, reaching the messages through a `set` alias and a slice.
OPENAI_TEMPLATE = ("{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% for part in m.content %}"
                   "{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endfor %}")

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
AGENT_LOOP = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "input_text", "text": "Paris?"}],
     "name": "ana"},
    {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "I should call it."},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 C"}, "sunny"]},
]


def test_template_content_format_is_detected_as_vllm_does():
    assert detect_content_format(STRING_TEMPLATE) == "string"
    assert detect_content_format(OPENAI_TEMPLATE) == "openai"
    assert detect_content_format(CHAT_TEMPLATE) == "openai"  # it loops over content when it is not a string
    # a loop over something else's content, a `{% generation %}` block, loop controls: still parsed
    assert detect_content_format("{% for d in documents %}{% for p in d.content %}{{ p }}{% endfor %}{% endfor %}"
                                 "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
                                 "{% if loop.index > 9 %}{% break %}{% endif %}{% endfor %}") == "string"
    assert detect_content_format("{% for m in messages %}{{ m.content") == "string"  # does not parse


def test_an_agent_loop_is_shaped_for_a_string_template():
    system, user, assistant, tool = conversation_for_template(AGENT_LOOP, STRING_TEMPLATE)
    assert system == {"role": "system", "content": "Be brief."}
    assert user == {"role": "user", "content": "Weather in\nParis?", "name": "ana"}  # parts joined as vLLM joins
    # null content is "" (the template prints it); arguments are an object, as tool-use templates expect
    assert assistant == {"role": "assistant", "content": "", "reasoning": "I should call it.",
                         "reasoning_content": "I should call it.",
                         "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert tool == {"role": "tool", "content": "18 C\nsunny", "tool_call_id": "call_1"}
    assert AGENT_LOOP[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's untouched


def test_an_agent_loop_is_shaped_for_an_openai_template():
    without_content = [*AGENT_LOOP[:2], {"role": "assistant", "tool_calls": [CALL]}, AGENT_LOOP[3]]
    system, user, assistant, tool = conversation_for_template(without_content, OPENAI_TEMPLATE)
    assert system["content"] == [{"type": "text", "text": "Be brief."}]
    assert user["content"] == [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]
    assert assistant["content"] == []  # absent content: no parts
    assert tool["content"] == "18 C\nsunny"  # a tool result stays one string, which tool templates print
    # the format can be forced either way
    assert conversation_for_template(AGENT_LOOP[:1], OPENAI_TEMPLATE, "string")[0]["content"] == "Be brief."
    assert conversation_for_template([{"role": "user", "content": "hi"}], STRING_TEMPLATE, "openai")[0][
        "content"] == [{"type": "text", "text": "hi"}]


@pytest.mark.parametrize(("arguments", "given"), [
    ('{"a": 1}', {"a": 1}), ({"a": 1}, {"a": 1}), ("", {}), (None, {}),
    ("{not json", "{not json"), ("5", "5"),  # what the model wrote stays, when it is no JSON object
    ("[" * 100 + "]" * 100, "[" * 100 + "]" * 100), ("[" * 5000 + "]" * 5000, "[" * 5000 + "]" * 5000),  # too deep
])
def test_tool_call_arguments_reach_the_template_as_an_object(arguments, given):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    (message,) = conversation_for_template([{"role": "assistant", "tool_calls": [call]}], STRING_TEMPLATE)
    assert message["tool_calls"][0]["function"]["arguments"] == given


def test_empty_tool_calls_and_empty_parts_are_left_out():
    messages = [{"role": "assistant", "content": [{"type": "text", "text": None}, {"type": "refusal",
                                                                                 "refusal": "No."}],
                 "tool_calls": []}]
    assert conversation_for_template(messages, STRING_TEMPLATE) == [{"role": "assistant", "content": "No."}]


@pytest.mark.parametrize(("message", "field", "words"), [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[0].content[0].type",
     "'image_url' is not supported"),
    ({"role": "user", "content": [{"text": "no type"}]}, "messages[0].content[0].type", "None is not supported"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[0].content[0].text", "must be a string"),
    ({"role": "user", "content": 5}, "messages[0].content", "got int"),
    ({"role": "assistant", "tool_calls": [{"id": "c"}]}, "messages[0].tool_calls[0].function", "\"name\""),
    ({"role": "assistant", "tool_calls": {"id": "c"}}, "messages[0].tool_calls", "must be a list"),
])
def test_what_cannot_be_read_is_a_request_error_naming_the_part(message, field, words):
    with pytest.raises(RequestError) as caught:
        conversation_for_template([message], STRING_TEMPLATE)
    assert caught.value.field == field and words in caught.value.message


def test_a_conversation_nested_past_the_stack_is_a_request_error(tmp_path):
    from asyncengine.frontend.tokenizer import load_tokenizer, render_chat
    from support.tiny_tokenizer import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path)
    deep: dict = {}
    for _ in range(2000):
        deep = {"a": deep}
    call = {"id": "c", "type": "function", "extra": deep, "function": {"name": "f", "arguments": "{}"}}
    with pytest.raises(RequestError, match="nests lists or objects too deeply") as caught:
        render_chat(load_tokenizer(tmp_path), [{"role": "assistant", "tool_calls": [call]}])
    assert caught.value.field == "messages"
