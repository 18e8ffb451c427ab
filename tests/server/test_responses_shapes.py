"""The Responses API's pure parts, in-process: input items as chat messages, the output items and stream
events built from the chat machinery's deltas, the bounded store, and errors renamed to the Responses'
fields. The real server, through the official client, is tests/server/test_responses_api.py."""

from __future__ import annotations

import msgspec
import pytest

from asyncengine.server.errors import ApiError
from asyncengine.interfaces.parsers import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from asyncengine.server.protocol_responses import (
    FunctionCallItem, OutputMessage, ReasoningItem, ReasoningText, ResponsesRequest, ResponsesResponse,
)
from asyncengine.server.responses_conversation import (
    chat_request, input_messages, output_messages, responses_error,
)
from asyncengine.server.responses_output import OutputBuilder
from asyncengine.server.responses_store import ResponseStore, StoredResponse


def request(**fields) -> ResponsesRequest:
    return msgspec.convert({"input": "x", **fields}, ResponsesRequest)


def items(*values: dict) -> list:
    return request(input=list(values)).input


def types(events) -> list[str]:
    return [type(event).__struct_config__.tag for event in events]


# -- input items -> chat messages -----------------------------------------------------------------------


def test_a_turn_of_reasoning_text_and_calls_is_one_assistant_message_then_tool_results():
    messages = input_messages(items(
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "20C"}]},
    ))
    assert messages == [
        {"role": "system", "content": "Be brief."},  # developer: a system message, which every template knows
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "reasoning": "Look it up.", "content": [{"type": "text", "text": "Checking."}],
         "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "20C"}]},
    ]
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_output_items_become_the_assistant_turn_they_were():
    output = [ReasoningItem(id="rs", status="completed", content=[ReasoningText(text="hmm")]),
              OutputMessage(id="m", status="completed", content=[]),
              FunctionCallItem(id="fc", call_id="call_9", name="f", arguments="{}", status="completed")]
    assert output_messages(output) == [{"role": "assistant", "reasoning": "hmm", "content": "",
                                        "tool_calls": [{"id": "call_9", "type": "function",
                                                        "function": {"name": "f", "arguments": "{}"}}]}]


def test_the_chat_request_carries_the_responses_fields_in_chats_names():
    chat = chat_request(request(
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"}, max_output_tokens=7, temperature=0.5, top_p=0.9,
        text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
        reasoning={"effort": "low"}, include=["message.output_text.logprobs"], top_logprobs=2, stream=True),
        [{"role": "user", "content": "x"}])
    assert chat.max_completion_tokens == 7 and (chat.temperature, chat.top_p) == (0.5, 0.9) and chat.stream
    assert chat.tools[0].function.name == "f" and chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"},
                                                                          "strict": True}}
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}  # vLLM's name for it
    assert chat.logprobs and chat.top_logprobs == 2
    plain = chat_request(request(top_logprobs=2), [{"role": "user", "content": "x"}])
    assert not plain.logprobs and plain.top_logprobs is None  # top_logprobs alone asks for nothing (OpenAI's rule)


@pytest.mark.parametrize("item, param", [
    ({"type": "web_search_call"}, "input[0].type"), ({"type": "item_reference", "id": "x"}, "input[0].type"),
    ({"role": "robot", "content": "x"}, "input[0].role"), ({"content": "x"}, "input[0].role"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}, "input[0].content[0].type"),
    ({"type": "function_call", "name": "f"}, "input[0].call_id"),
    ({"type": "function_call", "call_id": "c"}, "input[0].name"),
    ({"type": "function_call_output", "output": "x"}, "input[0].call_id"),
    ({"type": "reasoning", "summary": [], "encrypted_content": "opaque"}, "input[0].encrypted_content"),
])
def test_an_item_that_cannot_be_read_is_a_400_naming_it(item, param):
    with pytest.raises(ApiError) as info:
        input_messages(items(item))
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("chat_param, param", [
    ("max_tokens", "max_output_tokens"), ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"), ("structured_outputs.json", "text.format.schema"),
    ("tools[2].function.parameters", "tools[2].parameters"), ("messages[3].content", "input"),
    ("temperature", "temperature"), (None, None),
])
def test_errors_of_the_chat_machinery_name_the_responses_field(chat_param, param):
    error = responses_error(ApiError(400, f"{chat_param} is wrong", param=chat_param), request())
    assert error.param == param and error.status == 400
    if chat_param and param != "input":
        assert error.message == f"{param} is wrong"


# -- output items and stream events ---------------------------------------------------------------------


def call_delta(index: int, arguments: str, name: str | None = None, call_id: str | None = None) -> DeltaMessage:
    return DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=call_id, function=DeltaFunctionCall(
        name=name, arguments=arguments))])


def test_a_text_response_streams_openais_sequence_and_ends_with_the_whole_text():
    builder = OutputBuilder()
    events = [event for text in ["Hel", "lo", "!"] for event in builder.add(DeltaMessage(content=text))]
    events += builder.finish("completed")
    assert types(events) == ["response.output_item.added", "response.content_part.added",
                             *["response.output_text.delta"] * 3, "response.output_text.done",
                             "response.content_part.done", "response.output_item.done"]
    (message,) = builder.items
    assert isinstance(message, OutputMessage) and message.status == "completed"
    assert message.content[0].text == events[-3].text == "Hello!"
    assert {event.item_id for event in events[1:-1]} == {message.id} and events[0].item.status == "in_progress"


def test_reasoning_then_text_then_two_calls_are_four_items_in_order():
    builder = OutputBuilder()
    events = builder.add(DeltaMessage(reasoning="Think"))
    events += builder.add(DeltaMessage(reasoning=" more", content="Answer"))
    events += builder.add(call_delta(0, '{"a":', name="f", call_id="call_a"))
    events += builder.add(call_delta(0, " 1}"))
    events += builder.add(call_delta(1, "{}", name="g", call_id="call_b"))
    events += builder.finish("completed")
    assert types(events) == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    reasoning, message, first, second = builder.items
    assert reasoning.content[0].text == "Think more" and message.content[0].text == "Answer"
    assert (first.call_id, first.name, first.arguments) == ("call_a", "f", '{"a": 1}')
    assert (second.call_id, second.name, second.arguments) == ("call_b", "g", "{}")
    assert [event.output_index for event in events if hasattr(event, "output_index")][-1] == 3


def test_arguments_held_back_past_the_next_call_complete_their_own_item():
    builder = OutputBuilder()
    events = builder.add(call_delta(0, '{"a"', name="f", call_id="c0"))
    events += builder.add(call_delta(1, "{}", name="g", call_id="c1"))
    events += builder.add(call_delta(0, ": 1}"))  # a parser's flush at the end
    events += builder.finish("completed")
    first, second = builder.items
    assert (first.arguments, second.arguments) == ('{"a": 1}', "{}") and len(builder.items) == 2
    late = [event for event in events if getattr(event, "delta", None) == ": 1}"]
    assert late and late[0].item_id == first.id


def test_an_empty_answer_is_one_empty_message_and_a_cut_one_is_incomplete():
    builder = OutputBuilder()
    assert types(builder.finish("completed"))[0] == "response.output_item.added"
    assert builder.items[0].content[0].text == ""
    cut = OutputBuilder()
    cut.add(DeltaMessage(content="Once upon"))
    cut.finish("incomplete")
    assert cut.items[0].status == "incomplete"


def test_the_events_and_the_response_are_openais_types():
    openai_types = pytest.importorskip("openai.types.responses")
    from pydantic import TypeAdapter

    builder = OutputBuilder()
    events = builder.add(DeltaMessage(reasoning="r", content="c")) + builder.add(call_delta(0, "{}", "f", "c1"))
    events += builder.finish("completed")
    adapter = TypeAdapter(openai_types.ResponseStreamEvent)
    for event in events:
        parsed = adapter.validate_python(msgspec.to_builtins(event))  # strict validation, not construct
        assert parsed.type == type(event).__struct_config__.tag
    response = ResponsesResponse(id="resp_1", created_at=1, model="m", status="completed", output=builder.items)
    assert openai_types.Response.model_validate(msgspec.to_builtins(response)).output[2].call_id == "c1"


# -- the store ------------------------------------------------------------------------------------------


def stored(response_id: str, status: str = "completed", text: str = "") -> StoredResponse:
    response = ResponsesResponse(id=response_id, created_at=1, model="m", status=status, output=[])
    return StoredResponse(response, [{"role": "user", "content": text}])


def test_the_store_evicts_the_oldest_finished_responses_past_either_bound():
    store = ResponseStore(max_entries=3, max_bytes=10**6)
    for name in "abcd":
        store.put(stored(name))
    assert [store.get(name) is not None for name in "abcd"] == [False, True, True, True] and len(store) == 3
    store.put(stored("b", text="updated"))  # an update keeps its place: age is creation's
    store.put(stored("e"))
    assert store.get("b") is None and store.get("e") is not None
    by_bytes = ResponseStore(max_entries=100, max_bytes=2000)
    for index in range(5):
        by_bytes.put(stored(f"r{index}", text="x" * 600))
    assert by_bytes.num_bytes <= 2000 and by_bytes.get("r4") is not None and by_bytes.get("r0") is None


def test_a_running_response_is_never_evicted():
    store = ResponseStore(max_entries=2, max_bytes=10**6)
    store.put(stored("running", status="in_progress"))
    for name in "abc":
        store.put(stored(name))
    assert store.get("running") is not None and store.get("a") is None and len(store) == 2
    assert not ResponseStore(0, 10**6).enabled
