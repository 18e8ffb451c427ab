"""Every built-in tool-call and reasoning parser on the texts its models write (tests/support/parser_samples.py),
whole and streamed: each text is streamed in several chunkings (token-like pieces, pairs of them, and
fixed sizes down to one character at a time), and what the deltas add up to must be the whole result.

Pure logic, in this process: parsers read text, not tokens.
"""

from __future__ import annotations

import functools
import json
import random
import re
from types import SimpleNamespace

import msgspec
import pytest
import trio

from asyncengine.errors import ConfigError
from asyncengine.interfaces.registry import BUILT_IN
from asyncengine.server.parsers import DeltaMessage, ReasoningParserManager, ToolParserManager
from asyncengine.server.parsers.incremental import IncrementalToolParser
from asyncengine.server.parsers.qwen3_coder_tool_parser import convert_parameter
from asyncengine.server.parsers.selection import check_configured_parsers
from asyncengine.server.protocol import ChatCompletionRequest, ResponseMessage, Tool
from support.parser_samples import (
    REASONING_SAMPLES,
    TOOL_SAMPLES,
    TYPED_TOOL,
    WEATHER_TOOL,
    ReasoningSample,
    ToolSample,
)
from support.parser_streams import feed, sized_chunks

# Special tokens whole, a word with its leading space, a run of white space, or one other character:
# roughly how a BPE tokenizer cuts these texts.
_TOKEN = re.compile(r"<[|｜][^<>]*?[|｜]>|\[[A-Z_]+\]|\s?\w+|\s+|.", re.DOTALL)


def token_chunks(text: str, per_chunk: int = 1) -> list[str]:
    tokens = _TOKEN.findall(text)
    assert "".join(tokens) == text
    return ["".join(tokens[i:i + per_chunk]) for i in range(0, len(tokens), per_chunk)]


def chunkings(text: str) -> dict[str, list[str]]:
    return {"tokens": token_chunks(text), "token pairs": token_chunks(text, 2), "1 char": sized_chunks(text, [1]),
            "2 chars": sized_chunks(text, [2]), "3-1-7": sized_chunks(text, [3, 1, 7]), "5 chars": sized_chunks(text, [5]),
            "whole": [text]}


def request_for(tools=None, chat_template_kwargs=None) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "Hi"}], "tools": tools,
                            "chat_template_kwargs": chat_template_kwargs}, ChatCompletionRequest)


def assembled_calls(deltas: list[DeltaMessage]) -> list[dict]:
    """The calls a client builds from the deltas, checking OpenAI's shape on the way: the first delta of
    a call carries its index, id, type and name; later ones only the index and argument fragments."""
    calls: list[dict] = []
    for delta in deltas:
        for call in delta.tool_calls or []:
            if call.index == len(calls):
                assert call.id and call.type == "function" and call.function and call.function.name
                calls.append({"id": call.id, "name": call.function.name, "arguments": call.function.arguments or ""})
            else:
                assert call.index < len(calls), "a call's first delta came after a later call's"
                assert call.id is None and call.type is None and call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments or ""
    return calls


def sample_id(sample) -> str:
    return f"{sample.parser}: {sample.label}"


# -- tool-call parsers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("sample", TOOL_SAMPLES, ids=sample_id)
def test_a_tool_parser_reads_what_its_models_write_whole_and_streamed(sample: ToolSample):
    parser_class = ToolParserManager.get_tool_parser(sample.parser)
    request = request_for(sample.tools)
    whole = parser_class(None).extract_tool_calls(sample.text, request)
    if sample.broken:
        assert (whole.tools_called, whole.tool_calls, whole.content) == (False, [], sample.text)
    else:
        assert whole.tools_called == bool(sample.calls)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == sample.calls
        assert whole.content == (sample.content if sample.calls else sample.text)
        assert all(c.type == "function" for c in whole.tool_calls)
        assert len({c.id for c in whole.tool_calls}) == len(whole.tool_calls)
    for name, pieces in chunkings(sample.text).items():
        deltas = feed(parser_class(None).extract_tool_calls_streaming, pieces, request)
        calls = assembled_calls(deltas)
        content = "".join(d.content or "" for d in deltas)
        if calls and sample.stream_begins:  # documented: the break showed inside a call the stream had begun
            assert [c["name"] for c in calls] == sample.stream_begins, name
            assert content and sample.text.endswith(content), name
            continue
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in whole.tool_calls], name
        if whole.tools_called:
            assert (content.strip() or None) == whole.content, name
        else:
            assert content == sample.text, name  # nothing held back: no text here ends in a marker's start


@pytest.mark.parametrize("name", ["llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_v3", "granite",
                                  "internlm", "llama4_pythonic", "deepseek_v31", "llama4_json"])
def test_every_named_tool_parser_is_built_in_keeps_special_tokens_and_has_samples(name):
    parser_class = ToolParserManager.get_tool_parser(name)
    assert issubclass(parser_class, IncrementalToolParser)
    assert ToolParserManager.owners()[name] == BUILT_IN
    tools = [{"type": "function", "function": {"name": "f"}}]
    kept = parser_class(None).adjust_request(request_for(tools))
    assert kept.skip_special_tokens is False
    assert parser_class(None).adjust_request(request_for()).skip_special_tokens is True  # no tools: untouched
    assert any(sample.parser == name for sample in TOOL_SAMPLES) or name in ("llama4_json",)


def test_mistral_call_ids_are_nine_letters_and_digits_as_its_templates_require():
    parser = ToolParserManager.get_tool_parser("mistral")
    text = '[TOOL_CALLS]add{"a": 1}[TOOL_CALLS]sub{"b": 2}'
    ids = [c.id for c in parser(None).extract_tool_calls(text, request_for()).tool_calls]
    ids += [c.id for d in feed(parser(None).extract_tool_calls_streaming, [text], request_for())
            for c in d.tool_calls or []]
    assert len(ids) == 4 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)


def test_arguments_stream_in_fragments_as_the_model_writes_them():
    parser = ToolParserManager.get_tool_parser("llama3_json")(None)
    text = '{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "celsius"}}'
    deltas = feed(parser.extract_tool_calls_streaming, token_chunks(text), request_for())
    fragments = [c.function.arguments for d in deltas for c in d.tool_calls or []]
    assert len(fragments) > 5  # the arguments go out piece by piece
    assert "".join(fragments) == '{"city": "San Francisco", "unit": "celsius"}'


def test_pythonic_and_xml_arguments_stream_one_argument_at_a_time():
    pythonic = ToolParserManager.get_tool_parser("pythonic")(None)
    text = '[f(a=1, b="x, y")]'
    deltas = feed(pythonic.extract_tool_calls_streaming, sized_chunks(text, [1]), request_for())
    assert [c.function.arguments for d in deltas for c in d.tool_calls or []] == ["", '{"a": 1', ', "b": "x, y"}']
    xml = ToolParserManager.get_tool_parser("qwen3_coder")(None)
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    deltas = feed(xml.extract_tool_calls_streaming, sized_chunks(text, [1]), request_for())
    assert [c.function.arguments for d in deltas for c in d.tool_calls or []] == ["", '{"a": "1"', "}"]


def test_a_stream_holds_back_only_what_could_begin_a_marker():
    parser = ToolParserManager.get_tool_parser("mistral")(None)
    request = request_for()
    assert parser.extract_tool_calls_streaming("", "Hi [TOOL", "Hi [TOOL", request) == DeltaMessage(content="Hi ")
    assert parser.extract_tool_calls_streaming("Hi [TOOL", "Hi [TOOLS] x", "S] x", request) == DeltaMessage(
        content="[TOOLS] x")


def test_a_call_that_breaks_after_an_earlier_one_was_sent_streams_the_rest_as_content():
    # Documented: a stream cannot take back a call it sent; the whole response, seeing the break, is content.
    parser_class = ToolParserManager.get_tool_parser("mistral")
    text = '[TOOL_CALLS]add{"a": 1}[TOOL_CALLS]oops{not json}'
    assert parser_class(None).extract_tool_calls(text, request_for()).content == text
    deltas = feed(parser_class(None).extract_tool_calls_streaming, token_chunks(text), request_for())
    assert [(c["name"], c["arguments"]) for c in assembled_calls(deltas)] == [("add", '{"a": 1}')]
    assert "".join(d.content or "" for d in deltas) == '[TOOL_CALLS]oops{not json}'


@pytest.mark.parametrize(("value", "schema", "expected"), [
    ("12", {"type": "integer"}, 12), ("twelve", {"type": "integer"}, "twelve"), ("2.50", {"type": "number"}, 2.5),
    ("3", {"type": "number"}, 3), ("inf", {"type": "number"}, "inf"), ("FALSE", {"type": "boolean"}, False),
    ("yes", {"type": "boolean"}, "yes"), ("null", {"type": "string"}, "null"),
    ("None", {"type": ["string", "null"]}, None), ("null", {"type": "integer"}, None),
    ('{"a": [1]}', {"type": "object"}, {"a": [1]}), ("[1, 'two']", {"type": "array"}, [1, "two"]),
    ("x", {}, "x"), (" padded ", {"type": "string"}, " padded "),
])
def test_qwen3_coder_converts_a_value_by_its_schema_type(value, schema, expected):
    assert convert_parameter(value, "p", {"p": schema}) == expected


def test_qwen3_coder_reads_the_schema_from_the_request_tools():
    tools = [msgspec.convert({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}}, Tool)]
    parser = ToolParserManager.get_tool_parser("qwen3_coder")(None)
    text = "<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>"
    [call] = parser.extract_tool_calls(text, SimpleNamespace(tools=tools)).tool_calls
    assert call.function.arguments == '{"n": 7}'


# -- reasoning parsers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("sample", REASONING_SAMPLES, ids=sample_id)
def test_a_reasoning_parser_splits_what_its_models_write_whole_and_streamed(sample: ReasoningSample):
    parser_class = ReasoningParserManager.get_reasoning_parser(sample.parser)
    request = request_for(chat_template_kwargs=sample.chat_template_kwargs)
    assert parser_class(None).extract_reasoning(sample.text, request) == (sample.reasoning, sample.content)
    for name, pieces in chunkings(sample.text).items():
        deltas = feed(parser_class(None).extract_reasoning_streaming, pieces, request)
        assert all(d.reasoning == d.reasoning_content for d in deltas)
        assert all(d.reasoning or d.content for d in deltas), "a delta that says nothing"
        reasoning = "".join(d.reasoning or "" for d in deltas) or None
        content = "".join(d.content or "" for d in deltas) or None
        assert (reasoning, content) == (sample.reasoning, sample.content), name


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3", "granite", "think"])
def test_every_named_reasoning_parser_is_built_in_and_has_samples(name):
    assert ReasoningParserManager.owners()[name] == BUILT_IN
    assert name == "think" or any(sample.parser == name for sample in REASONING_SAMPLES)


class Decoding:
    """A stand-in tokenizer whose token ids are characters: is_reasoning_end reads decoded text."""

    def decode(self, token_ids):
        return "".join(chr(i) for i in token_ids)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


@pytest.mark.parametrize(("name", "text", "ended"), [
    ("deepseek_r1", "<｜Assistant｜><think>\n", False), ("deepseek_r1", "so 4.</think>", True),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", True),  # enable_thinking off: the prompt closed it
    ("qwen3", "<|im_start|>assistant\n", False), ("qwen3", "hmm <tool_call>\n<function=f>", True),
    ("granite", "<|start_of_role|>assistant<|end_of_role|>", True),
    ("granite", "Here is my thought process: x", False), ("granite", "Here is my thought process: x Here is my response:", True),
])
def test_is_reasoning_end_reads_where_the_reasoning_closes(name, text, ended):
    parser = ReasoningParserManager.get_reasoning_parser(name)(Decoding())
    assert parser.is_reasoning_end(ids(text)) is ended


# -- the response field ---------------------------------------------------------------------------------

def test_reasoning_is_sent_under_both_names_and_reasoning_wins():
    assert msgspec.json.decode(msgspec.json.encode(DeltaMessage(reasoning="r"))) == {
        "reasoning": "r", "reasoning_content": "r"}
    assert DeltaMessage(reasoning_content="old").reasoning == "old"  # a plugin that sets the earlier name
    assert DeltaMessage(reasoning="a", reasoning_content="b").reasoning_content == "a"
    assert msgspec.json.encode(DeltaMessage(content="c")) == b'{"content":"c"}'
    message = ResponseMessage(content="c", reasoning="r", reasoning_content="r")
    assert msgspec.json.decode(msgspec.json.encode(message))["reasoning"] == "r"


# -- names checked before the engine starts --------------------------------------------------------------

class NeverStarted:
    @staticmethod
    def start(config):
        raise AssertionError("the engine started although a parser name is unknown")


@pytest.mark.parametrize(("option", "value", "known"), [
    ("tool_call_parser", "llama3-json", "'llama3_json'"), ("reasoning_parser", "deepseek", "'deepseek_r1'"),
])
def test_an_unknown_parser_name_fails_serve_before_the_engine_starts_listing_the_known_names(option, value, known):
    from asyncengine.config.engine import EngineConfig
    from asyncengine.server.config import ServerConfig
    from asyncengine.server.run import serve

    server_config = ServerConfig(**{option: value})
    with pytest.raises(ConfigError, match=re.escape(known)) as failed:
        trio.run(functools.partial(serve, EngineConfig(model="unused"), server_config, engine_class=NeverStarted))
    assert repr(value) in str(failed.value)
    check_configured_parsers(ServerConfig(tool_call_parser="qwen3_coder", reasoning_parser="qwen3"))


def test_an_unknown_name_waits_for_the_engine_while_an_allowed_general_plugin_may_register_it(monkeypatch):
    from importlib import metadata

    from asyncengine.plugin_runtime import groups
    from asyncengine.plugin_runtime.discovery import InstalledPlugin
    from asyncengine.server.config import ServerConfig
    from asyncengine.server.parsers import selection

    entry_point = metadata.EntryPoint("my_parsers", "my_parsers:register", groups.GENERAL.entry_point_group)
    plugin = InstalledPlugin(groups.GENERAL, "my_parsers", entry_point.value, "my-parsers", "1.0", entry_point)
    monkeypatch.setattr(selection, "installed_plugins", lambda: [plugin])
    config = ServerConfig(tool_call_parser="registered_by_my_parsers")
    check_configured_parsers(config, None)  # it may register the name as it loads: the app's lookup decides
    check_configured_parsers(config, "my_parsers")
    with pytest.raises(ConfigError, match="unknown tool parser 'registered_by_my_parsers'"):
        check_configured_parsers(config, "another_plugin")  # the allow-list keeps it from loading


def test_no_text_makes_a_parser_raise():
    """Mutated samples (markers, quotes, brackets and escapes inserted, text cut or dropped): every parser,
    whole and streamed, answers; a text it does not read as calls comes back whole as content."""
    rng = random.Random(32)
    pieces = list('{}[]()"\'\\:,;=<>\n a1.-') + ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]",
                                                 "<|python_tag|>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                                 "<parameter=", "</function>", "```json\n", "\\x", "\\ud800", "1e999",
                                                 "</think>", "<think>", "Here is my response:"]
    texts = [sample.text for sample in TOOL_SAMPLES] + [sample.text for sample in REASONING_SAMPLES]
    request = request_for([WEATHER_TOOL, TYPED_TOOL])
    for _ in range(150):
        text = list(rng.choice(texts))
        for _ in range(rng.randint(1, 4)):
            at = rng.randint(0, len(text))
            text = text[:at] + [rng.choice(pieces)] + text[at:] if rng.random() < 0.6 else text[:at]
        mutated = "".join(text)
        for name in ToolParserManager.keys():
            parser_class = ToolParserManager.get_tool_parser(name)
            whole = parser_class(None).extract_tool_calls(mutated, request)
            assert whole.tools_called or whole.content == mutated
            feed(parser_class(None).extract_tool_calls_streaming, sized_chunks(mutated, [rng.randint(1, 9)]), request)
        for name in ReasoningParserManager.keys():
            parser_class = ReasoningParserManager.get_reasoning_parser(name)
            parser_class(None).extract_reasoning(mutated, request)
            feed(parser_class(None).extract_reasoning_streaming, sized_chunks(mutated, [rng.randint(1, 9)]), request)
