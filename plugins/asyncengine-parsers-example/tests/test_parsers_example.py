"""The example_fn tool parser and the example_brackets reasoning parser: whole and streamed (in many
chunkings, finished the way the server finishes a stream: a whole parse sends what was held back),
and their registration."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import ae_parsers_example
from ae_parsers_example import (
    BracketsReasoningParser,
    ExampleFnToolParser,
    parse_call_line,
    register,
)
from asyncengine.plugins_api import ReasoningParserManager, ToolParserManager

REQUEST = SimpleNamespace(tools=None)
SPLITS = [[1], [2], [3], [1, 4, 2, 7], [5, 1, 1, 3], [11], [10_000]]


def chunks(text: str, sizes: list[int]) -> list[str]:
    out, position, i = [], 0, 0
    while position < len(text):
        size = sizes[i % len(sizes)]
        out.append(text[position:position + size])
        position += size
        i += 1
    return out


def rest(full, sent):
    """What the server sends at the end of a choice: the part of the whole result not sent yet."""
    if not full or not full.startswith(sent):
        return ""
    return full[len(sent):]


# -- example_fn, whole ------------------------------------------------------------------------------

def test_call_lines_are_calls_and_the_other_lines_content():
    output = 'Let me look.\nFUNCTION get_weather({"city": "Paris", "unit": "C"})\nFUNCTION now()\nDone.'
    extracted = ExampleFnToolParser(None).extract_tool_calls(output, REQUEST)
    assert extracted.tools_called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in extracted.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("now", {})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in extracted.tool_calls)
    assert len({c.id for c in extracted.tool_calls}) == 2
    assert extracted.content == "Let me look.\nDone."


def test_only_calls_gives_no_content():
    extracted = ExampleFnToolParser(None).extract_tool_calls('  FUNCTION f({"a": [1, 2]})  \n\n', REQUEST)
    assert extracted.tools_called and extracted.content is None
    assert json.loads(extracted.tool_calls[0].function.arguments) == {"a": [1, 2]}


@pytest.mark.parametrize("output", [
    "Hello there.",
    "I would call FUNCTION f({}) here.",  # not a line of its own
    'FUNCTION f([1, 2])',  # arguments that are not an object
    'FUNCTION f({"a": )',  # not JSON
    'FUNCTION 9f({})',  # not a name
    'FUNCTIONf({})',
    "",
])
def test_no_call_leaves_the_output_as_content(output):
    extracted = ExampleFnToolParser(None).extract_tool_calls(output, REQUEST)
    assert not extracted.tools_called and extracted.tool_calls == [] and extracted.content == output


def test_parse_call_line():
    assert parse_call_line('FUNCTION a.b-c({"x": "é"})\n').name == "a.b-c"
    assert json.loads(parse_call_line('FUNCTION f({"x": "é"})').arguments) == {"x": "é"}
    assert parse_call_line("FUNCTION f( )").arguments == "{}"
    assert parse_call_line("FUNCTION f({})\nFUNCTION g({})") is None  # one line only


# -- example_fn, streamed ---------------------------------------------------------------------------

TOOL_OUTPUTS = [
    'Let me look.\nFUNCTION get_weather({"city": "Paris"})\nFUNCTION now()\nDone.',
    'FUNCTION get_weather({"city": "Paris"})',  # a last line without a newline: settled at the end
    "FUNCTIONAL programming\nis fun\n",
    "FUNCTION broken({\nstill content",
    "plain text, no calls at all",
    '  FUNCTION f({"a": 1})\n  indented text\n',
    "FUN",
]


def stream_tools(output: str, sizes: list[int]):
    parser = ExampleFnToolParser(None)
    text, content, calls = "", "", []
    for delta_text in chunks(output, sizes):
        previous, text = text, text + delta_text
        delta = parser.extract_tool_calls_streaming(previous, text, delta_text, REQUEST)
        if delta is not None:
            content += delta.content or ""
            calls += delta.tool_calls or []
    # The end of the choice: the server parses the whole text and sends what is missing.
    whole = ExampleFnToolParser(None).extract_tool_calls(output, REQUEST)
    if whole.tools_called:
        content += rest(whole.content, content)
        calls += [SimpleNamespace(index=i, function=c.function) for i, c in enumerate(whole.tool_calls)
                  if i >= len(calls)]
    else:
        content += rest(whole.content, content)
    return whole, content, calls


@pytest.mark.parametrize("output", TOOL_OUTPUTS)
@pytest.mark.parametrize("sizes", SPLITS)
def test_streamed_calls_and_content_add_up_to_the_whole_ones(output, sizes):
    whole, content, calls = stream_tools(output, sizes)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls]
    assert [c.index for c in calls] == list(range(len(calls)))
    assert content == (whole.content or "")


def test_a_streamed_call_is_sent_as_soon_as_its_line_ends():
    parser = ExampleFnToolParser(None)
    assert parser.extract_tool_calls_streaming("", "FUNCTION f(", "FUNCTION f(", REQUEST) is None  # held back
    delta = parser.extract_tool_calls_streaming("FUNCTION f(", 'FUNCTION f({"a": 1})\nok', '{"a": 1})\nok', REQUEST)
    assert [(c.index, c.function.name, c.function.arguments) for c in delta.tool_calls] == [(0, "f", '{"a": 1}')]
    assert delta.tool_calls[0].id.startswith("call_") and delta.content == "ok"  # "ok" cannot begin a call


def test_text_that_cannot_be_a_call_streams_at_once():
    parser = ExampleFnToolParser(None)
    delta = parser.extract_tool_calls_streaming("", "Hello", "Hello", REQUEST)
    assert delta.content == "Hello" and delta.tool_calls is None
    delta = parser.extract_tool_calls_streaming("Hello", "Hello FUNCTION", " FUNCTION", REQUEST)
    assert delta.content == " FUNCTION"  # the rest of a line judged content is content


# -- example_brackets -------------------------------------------------------------------------------

@pytest.mark.parametrize("output, expected", [
    ("[[think first]]The answer is 4.", ("think first", "The answer is 4.")),
    ("  [[a]]b", ("a", "b")),
    ("[[never closed", ("never closed", None)),
    ("[[]]only content", (None, "only content")),
    ("[[a]]", ("a", None)),
    ("[[a]]]b", ("a", "]b")),
    ("No brackets here.", (None, "No brackets here.")),
    ("Text then [[not reasoning]]", (None, "Text then [[not reasoning]]")),
    ("[single", (None, "[single")),
    ("", (None, None)),
])
def test_whole_reasoning(output, expected):
    assert BracketsReasoningParser(None).extract_reasoning(output, REQUEST) == expected


REASONING_OUTPUTS = ["[[think first]]The answer is 4.", "  [[a]]b", "[[never ]closed]", "[[a]]]b",
                     "No brackets here.", " [x] ok", "[", "[[x]", "Text [[not]]"]


@pytest.mark.parametrize("output", REASONING_OUTPUTS)
@pytest.mark.parametrize("sizes", SPLITS)
def test_streamed_reasoning_adds_up_to_the_whole(output, sizes):
    parser = BracketsReasoningParser(None)
    text, reasoning, content = "", "", ""
    for delta_text in chunks(output, sizes):
        previous, text = text, text + delta_text
        delta = parser.extract_reasoning_streaming(previous, text, delta_text, REQUEST)
        if delta is not None:
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
    whole_reasoning, whole_content = BracketsReasoningParser(None).extract_reasoning(output, REQUEST)
    reasoning += rest(whole_reasoning, reasoning)
    content += rest(whole_content, content)
    assert (reasoning or None, content or None) == (whole_reasoning, whole_content)


def test_a_reply_without_brackets_streams_as_content_at_once():
    delta = BracketsReasoningParser(None).extract_reasoning_streaming("", "Hi", "Hi", REQUEST)
    assert delta.content == "Hi" and delta.reasoning_content is None


def test_streaming_holds_back_only_what_may_become_a_bracket_pair():
    parser = BracketsReasoningParser(None)
    assert parser.extract_reasoning_streaming("", " [", " [", REQUEST) is None
    delta = parser.extract_reasoning_streaming(" [", " [[abc]", "[abc]", REQUEST)
    assert delta.reasoning_content == "abc" and delta.content is None  # "]" held back
    delta = parser.extract_reasoning_streaming(" [[abc]", " [[abc]]xyz", "]xyz", REQUEST)
    assert delta.reasoning_content is None and delta.content == "xyz"


# -- registration and records -----------------------------------------------------------------------

def test_register_fills_both_registries_and_is_idempotent():
    register()
    register()  # the same implementation again: a no-op
    assert ToolParserManager.get_tool_parser("example_fn") is ExampleFnToolParser
    assert ReasoningParserManager.get_reasoning_parser("example_brackets") is BracketsReasoningParser


def test_records_name_the_process_once_per_step(tmp_path, monkeypatch):
    records = tmp_path / "records.jsonl"
    monkeypatch.setenv("AE_PLUGIN_RECORD", str(records))
    monkeypatch.setattr(ae_parsers_example, "current_process_role", lambda: "frontend")
    monkeypatch.setattr(ae_parsers_example, "_recorded", set())
    register()
    for _ in range(2):
        ExampleFnToolParser(None).extract_tool_calls("x", REQUEST)
        BracketsReasoningParser(None).extract_reasoning_streaming("", "x", "x", REQUEST)
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert [line["what"] for line in lines] == ["parsers registered", "tool parser extract_tool_calls",
                                                "reasoning parser extract_reasoning_streaming"]
    assert {(line["role"]) for line in lines} == {"frontend"}
