"""Tool-call and reasoning parsers: the built-ins (whole and streamed), their registries, and plugin loading.

Registrations are process-global, so every test registers under names of its own.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from types import SimpleNamespace

import msgspec
import pytest

from asyncengine.errors import ConfigError, StartupError
from asyncengine.interfaces.registry import BUILT_IN, RegistrationError, current_registrant
from asyncengine.server.parsers import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    JsonTagsToolParser,
    ReasoningParser,
    ReasoningParserManager,
    ThinkReasoningParser,
    FunctionCall,
    ToolCall,
    ToolParser,
    ToolParserManager,
    new_tool_call_id,
)
from asyncengine.server.parsers.tool_parsers import TOOL_CALL_START
from support.parser_streams import feed, sized_chunks as chunks

REQUEST = SimpleNamespace(tools=None)

# Chunk sizes for driving a stream: every split point lands inside a tag somewhere in these outputs.
SPLITS = [[1], [2], [3], [1, 4, 2, 7], [5, 1, 1, 3], [11], [10_000]]


def stream(method, text: str, sizes: list[int]) -> list[DeltaMessage]:
    """Feed `text` to a streaming method delta by delta, as the route does; the non-None results."""
    return feed(method, chunks(text, sizes), REQUEST)


def joined(deltas: list[DeltaMessage], field: str) -> str:
    return "".join(getattr(d, field) or "" for d in deltas)


def streamed_calls(deltas: list[DeltaMessage]) -> list[DeltaToolCall]:
    return [call for d in deltas for call in (d.tool_calls or [])]


# -- types ----------------------------------------------------------------------------------------

def test_tool_call_ids_are_call_and_24_random_hex_characters():
    ids = {new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_deltas_encode_without_unset_fields_and_tool_calls_keep_their_type():
    delta = DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a"'))])
    assert msgspec.json.encode(delta) == b'{"tool_calls":[{"index":0,"function":{"arguments":"{\\"a\\""}}]}'
    call = ToolCall(id="call_x", function=FunctionCall(name="f", arguments="{}"))
    assert msgspec.json.encode(call) == b'{"id":"call_x","type":"function","function":{"name":"f","arguments":"{}"}}'


# -- json_tags, whole -----------------------------------------------------------------------------

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}</tool_call>'
STRING_ARGS = '<tool_call>{"name": "echo", "arguments": "{\\"text\\": \\"<hi>\\"}"}</tool_call>'


def test_json_tags_finds_one_call_and_the_content_around_it():
    result = JsonTagsToolParser(None).extract_tool_calls(f"Let me check.\n{WEATHER}\n", REQUEST)
    assert result.tools_called is True
    assert result.content == "Let me check."
    [call] = result.tool_calls
    assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_json_tags_finds_several_calls_with_parameters_and_string_arguments():
    output = f"{WEATHER}\n{TIME}\n{STRING_ARGS}\nDone."
    result = JsonTagsToolParser(None).extract_tool_calls(output, REQUEST)
    assert result.tools_called is True
    assert [(c.function.name, c.function.arguments) for c in result.tool_calls] == [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
        ("get_time", '{"tz": "Europe/Paris"}'),
        ("echo", '{"text": "<hi>"}'),  # already a JSON string: passed through as it is
    ]
    assert len({c.id for c in result.tool_calls}) == 3
    assert result.content == "Done."


def test_json_tags_content_is_none_when_only_calls_and_whitespace():
    result = JsonTagsToolParser(None).extract_tool_calls(f"  {WEATHER}\n\n", REQUEST)
    assert result.tools_called is True and result.content is None


def test_json_tags_without_tags_is_all_content_unchanged():
    result = JsonTagsToolParser(None).extract_tool_calls("  Just an answer.\n", REQUEST)
    assert result == type(result)(tools_called=False, tool_calls=[], content="  Just an answer.\n")


@pytest.mark.parametrize("bad_block", [
    '<tool_call>{"name": "f", "arguments": {</tool_call>',  # not JSON
    '<tool_call>["f"]</tool_call>',  # JSON, not an object
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
])
def test_json_tags_an_invalid_block_makes_the_whole_output_content(bad_block):
    output = f"Hmm. {WEATHER} {bad_block} after"
    result = JsonTagsToolParser(None).extract_tool_calls(output, REQUEST)
    assert (result.tools_called, result.tool_calls, result.content) == (False, [], output)


def test_json_tags_a_final_block_missing_its_closing_tag_still_counts():
    result = JsonTagsToolParser(None).extract_tool_calls('Ok <tool_call>{"name": "f", "arguments": {}}', REQUEST)
    assert result.tools_called is True and result.content == "Ok"
    assert [(c.function.name, c.function.arguments) for c in result.tool_calls] == [("f", "{}")]


# -- json_tags, streamed --------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", SPLITS)
@pytest.mark.parametrize("output", [
    f"Let me check.\n{WEATHER}\n",
    f"{WEATHER}\n{TIME}\n{STRING_ARGS}\nDone.",
    f"a < b and <tool <tool_ca{TIME} then </tool_call> text",
    "No tools here, only <b>text</b> and a lone <tool",
    'Ok <tool_call>{"name": "f", "arguments": {}}',
])
def test_json_tags_streaming_matches_the_whole_output(output, sizes):
    whole = JsonTagsToolParser(None).extract_tool_calls(output, REQUEST)
    deltas = stream(JsonTagsToolParser(None).extract_tool_calls_streaming, output, sizes)
    calls = streamed_calls(deltas)
    assert [c.index for c in calls] == list(range(len(whole.tool_calls)))
    assert all(c.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls
    ]
    content = joined(deltas, "content")
    if whole.tools_called:
        assert (content.strip() or None) == whole.content
    else:
        held_back = len("<tool") if output.endswith("<tool") else 0  # a stream cannot tell it is over
        assert content == output[: len(output) - held_back]
    if whole.tools_called:  # no opening tag goes out as content (stray text like "<tool_ca" may)
        assert all(TOOL_CALL_START not in (delta.content or "") for delta in deltas)


def test_json_tags_streaming_sends_content_at_once_and_holds_only_a_possible_tag():
    parser = JsonTagsToolParser(None)
    assert parser.extract_tool_calls_streaming("", "Hello <", "Hello <", REQUEST) == DeltaMessage(content="Hello ")
    assert parser.extract_tool_calls_streaming("Hello <", "Hello <tool_", "tool_", REQUEST) is None
    assert parser.extract_tool_calls_streaming(
        "Hello <tool_", "Hello <tool_box", "box", REQUEST
    ) == DeltaMessage(content="<tool_box")


def test_json_tags_streaming_sends_a_call_when_its_json_completes():
    parser = JsonTagsToolParser(None)
    text = '<tool_call>{"name": "f", "arguments": {"x": 1}'
    assert parser.extract_tool_calls_streaming("", text, text, REQUEST) is None
    delta = parser.extract_tool_calls_streaming(text, text + "}", "}", REQUEST)
    [call] = delta.tool_calls
    assert (call.index, call.type, call.function.name, call.function.arguments) == (0, "function", "f", '{"x": 1}')
    assert delta.content is None
    closed = text + "}\n</tool_call>"
    assert parser.extract_tool_calls_streaming(text + "}", closed, "\n</tool_call>", REQUEST) is None
    assert parser.extract_tool_calls_streaming(closed, closed + " bye", " bye", REQUEST) == DeltaMessage(content=" bye")


@pytest.mark.parametrize("sizes", SPLITS)
def test_json_tags_streaming_an_invalid_first_block_goes_out_as_content(sizes):
    output = 'Try: <tool_call>{"name": oops}</tool_call> and <tool_call>{"name": "f"}</tool_call>'
    assert JsonTagsToolParser(None).extract_tool_calls(output, REQUEST).content == output
    deltas = stream(JsonTagsToolParser(None).extract_tool_calls_streaming, output, sizes)
    assert streamed_calls(deltas) == []
    assert joined(deltas, "content") == output


def test_json_tags_leaves_the_request_alone():
    assert JsonTagsToolParser(None).adjust_request(REQUEST) is REQUEST


# -- think, whole ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("output", "expected"), [
    ("<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
    ("Let me see.</think>Paris.", ("Let me see.", "Paris.")),  # the template opened the tag
    ("  <think>x</think>y", ("x", "y")),
    ("<think></think>Paris.", (None, "Paris.")),
    ("<think>still thinking", ("still thinking", None)),
    ("<think>", (None, None)),
    ("Paris.", (None, "Paris.")),
    ("a <think>b", (None, "a <think>b")),  # an opening tag counts only at the start
    ("thinking</think>", ("thinking", None)),
    ("", (None, None)),
])
def test_think_splits_reasoning_from_content(output, expected):
    assert ThinkReasoningParser(None).extract_reasoning(output, REQUEST) == expected


# -- think, streamed ------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", SPLITS)
@pytest.mark.parametrize("output", [
    "<think>\nLet me see: a < b, </thin is not a tag.\n</think>\n\nParis.",
    "Let me see.</think>Paris <think> stays in content.",
    "  <think>x</think>y",
    "<think></think>Paris.",
    "<think>still thinking",
    "<thinking>? no, </think>done",
])
def test_think_streaming_matches_the_whole_output(output, sizes):
    reasoning, content = ThinkReasoningParser(None).extract_reasoning(output, REQUEST)
    deltas = stream(ThinkReasoningParser(None).extract_reasoning_streaming, output, sizes)
    assert (joined(deltas, "reasoning_content") or None, joined(deltas, "content") or None) == (reasoning, content)
    for delta in deltas:
        assert not (delta.reasoning_content is None and delta.content is None)
        for text in (delta.reasoning_content or "", delta.content or ""):
            assert "</think>" not in text and not (text.startswith("<think>") and output.startswith("<think>"))


def test_think_streaming_without_tags_streams_as_reasoning():
    # Documented: a stream cannot know no </think> will come, so it treats the text as reasoning.
    deltas = stream(ThinkReasoningParser(None).extract_reasoning_streaming, "Paris.", [2])
    assert (joined(deltas, "reasoning_content"), joined(deltas, "content")) == ("Paris.", "")


def test_think_streaming_holds_only_a_possible_tag():
    parser = ThinkReasoningParser(None)
    assert parser.extract_reasoning_streaming("", "<th", "<th", REQUEST) is None
    assert parser.extract_reasoning_streaming("<th", "<think>abc</", "ink>abc</", REQUEST) == DeltaMessage(
        reasoning_content="abc"
    )
    assert parser.extract_reasoning_streaming(
        "<think>abc</", "<think>abc</think>Hi", "think>Hi", REQUEST
    ) == DeltaMessage(content="Hi")


# -- registries -----------------------------------------------------------------------------------

class Alpha(ToolParser):
    pass


class Beta(ToolParser):
    pass


class ThinkAlike(ReasoningParser):
    pass


def as_owner(owner: str, function, *args, **kwargs):
    token = current_registrant.set(owner)
    try:
        return function(*args, **kwargs)
    finally:
        current_registrant.reset(token)


def test_built_ins_are_registered_and_owned_by_built_in():
    assert ToolParserManager.get_tool_parser("json_tags") is JsonTagsToolParser
    assert ToolParserManager.get_tool_parser("hermes") is JsonTagsToolParser
    assert ReasoningParserManager.get_reasoning_parser("think") is ThinkReasoningParser
    assert ToolParserManager.owners()["json_tags"] == BUILT_IN
    assert ReasoningParserManager.owners()["think"] == BUILT_IN
    assert (ToolParserManager.name, ToolParserManager.what) == ("tool_parsers", "tool parser")
    assert (ReasoningParserManager.name, ReasoningParserManager.what) == ("reasoning_parsers", "reasoning parser")


def test_register_module_as_a_decorator_with_aliases_and_as_a_call():
    @ToolParserManager.register_module(["t_deco_a", "t_deco_b"])
    class Decorated(ToolParser):
        pass

    @ToolParserManager.register_module
    class TBareDecorated(ToolParser):
        pass

    assert ToolParserManager.register_module("t_call", module=Alpha) is Alpha
    ToolParserManager.register_module(module=Beta)  # the class name is the default name
    assert ToolParserManager.get_tool_parser("t_deco_a") is Decorated
    assert ToolParserManager.get_tool_parser("t_deco_b") is Decorated
    assert ToolParserManager.get_tool_parser("TBareDecorated") is TBareDecorated
    assert ToolParserManager.get_tool_parser("t_call") is Alpha
    assert ToolParserManager.get_tool_parser("Beta") is Beta
    assert ToolParserManager.owners()["t_call"] == "the calling script"


def test_registering_the_same_parser_twice_is_a_no_op_keeping_the_first_owner():
    as_owner("plugin 'a'", ToolParserManager.register_module, "t_twice", module=Alpha)
    as_owner("plugin 'b'", ToolParserManager.register_module, "t_twice", module=Alpha)
    as_owner("plugin 'b'", ToolParserManager.register_module, "t_twice", module=f"{__name__}:Alpha")
    assert ToolParserManager.owners()["t_twice"] == "plugin 'a'"
    assert ToolParserManager.get_tool_parser("t_twice") is Alpha


def test_a_clash_names_both_owners_and_force_overrides():
    as_owner("plugin 'a'", ToolParserManager.register_module, "t_clash", module=Alpha)
    with pytest.raises(RegistrationError) as caught:
        as_owner("plugin 'b'", ToolParserManager.register_module, "t_clash", module=Beta)
    assert str(caught.value) == (
        f"tool parser 't_clash' is already registered to {__name__}:Alpha (by plugin 'a'); plugin 'b' tried to "
        f"register {__name__}:Beta: pass force=True to register_module to replace it"
    )
    assert ToolParserManager.get_tool_parser("t_clash") is Alpha
    as_owner("plugin 'b'", ToolParserManager.register_module, "t_clash", force=True, module=Beta)
    assert ToolParserManager.get_tool_parser("t_clash") is Beta
    assert ToolParserManager.owners()["t_clash"] == "plugin 'b'"


def test_a_reasoning_parser_clash_is_reported_the_same_way():
    as_owner("plugin 'a'", ReasoningParserManager.register_module, "r_clash", module=ThinkAlike)
    with pytest.raises(RegistrationError) as caught:
        as_owner("plugin 'b'", ReasoningParserManager.register_module, "r_clash", module=ThinkReasoningParser)
    assert str(caught.value) == (
        f"reasoning parser 'r_clash' is already registered to {__name__}:ThinkAlike (by plugin 'a'); plugin 'b' "
        "tried to register asyncengine.server.parsers.reasoning_parsers:ThinkReasoningParser: pass force=True to "
        "register_module to replace it"
    )


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ConfigError) as caught:
        ToolParserManager.get_tool_parser("no_such_parser")
    known = ", ".join(repr(k) for k in ToolParserManager.keys())
    assert str(caught.value) == (
        f"unknown tool parser 'no_such_parser'; known: {known}. Pass one of these to --tool-call-parser, or load "
        "a plugin that registers it with --tool-parser-plugin"
    )
    assert caught.value.field == "tool_call_parser" and "'json_tags'" in known and "'hermes'" in known
    with pytest.raises(ConfigError) as caught:
        ReasoningParserManager.get_reasoning_parser("nope")
    assert caught.value.field == "reasoning_parser"
    assert str(caught.value).startswith("unknown reasoning parser 'nope'; known: ")
    assert "'think'" in str(caught.value) and "--reasoning-parser-plugin" in str(caught.value)


def test_a_lazy_path_is_imported_when_looked_up_and_checked():
    ToolParserManager.register_module("t_lazy", module=f"{__name__}:Alpha")
    assert ToolParserManager.get_tool_parser("t_lazy") is Alpha
    ToolParserManager.register_module("t_lazy_wrong", module=f"{__name__}:ThinkAlike")
    with pytest.raises(ConfigError, match=r"^tool parser 't_lazy_wrong' \(registered by the calling script\) is "
                                          r"<class '.*ThinkAlike'>, not a subclass of ToolParser"):
        ToolParserManager.get_tool_parser("t_lazy_wrong")
    ToolParserManager.register_module("t_lazy_missing", module="no_such_module_xyz:Parser")
    with pytest.raises(ConfigError, match=r"^tool parser 't_lazy_missing': importing 'no_such_module_xyz' failed"):
        ToolParserManager.get_tool_parser("t_lazy_missing")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "t_bad", "module": object}, "a tool parser must be a subclass of ToolParser (or a "
                                          "'package.module:Class' string), got <class 'object'>"),
    ({"name": "t_bad", "module": "not a path"}, "a tool parser given by path must look like 'package.module:Class', "
                                                "got 'not a path'"),
    ({"name": "", "module": Alpha}, "a tool parser name must be a non-empty string or a non-empty list of them, "
                                    "got ''"),
    ({"name": [], "module": Alpha}, "a tool parser name must be a non-empty string or a non-empty list of them, "
                                    "got []"),
])
def test_register_module_rejects_what_is_not_a_parser(kwargs, message):
    with pytest.raises(RegistrationError) as caught:
        ToolParserManager.register_module(**kwargs)
    assert str(caught.value) == message


# -- plugins --------------------------------------------------------------------------------------

PLUGIN_SOURCE = textwrap.dedent("""
    from asyncengine.server.parsers import ToolParser, ToolParserManager

    @ToolParserManager.register_module("{name}")
    class FromPlugin(ToolParser):
        pass
""")


def test_a_plugin_file_registers_its_parser_owned_by_the_option(tmp_path):
    path = tmp_path / "my_parsers.py"
    path.write_text(PLUGIN_SOURCE.format(name="t_from_file"))
    module = ToolParserManager.import_tool_parser(str(path))
    parser = ToolParserManager.get_tool_parser("t_from_file")
    assert parser.__name__ == "FromPlugin" and parser.__module__ == module.__name__
    assert sys.modules[module.__name__] is module
    assert ToolParserManager.owners()["t_from_file"] == f"--tool-parser-plugin {str(path)!r}"
    assert ToolParserManager.import_tool_parser(str(path)) is module  # the same file again: already loaded


def test_a_plugin_module_name_registers_its_reasoning_parser(tmp_path, monkeypatch):
    (tmp_path / "plugin_reasoning_mod_xyz.py").write_text(textwrap.dedent("""
        from asyncengine.server.parsers import ReasoningParser, ReasoningParserManager

        @ReasoningParserManager.register_module("r_from_module")
        class ModuleReasoning(ReasoningParser):
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    ReasoningParserManager.import_reasoning_parser("plugin_reasoning_mod_xyz")
    assert ReasoningParserManager.get_reasoning_parser("r_from_module").__name__ == "ModuleReasoning"
    assert ReasoningParserManager.owners()["r_from_module"] == "--reasoning-parser-plugin 'plugin_reasoning_mod_xyz'"


def test_a_missing_plugin_path_is_a_startup_error(tmp_path):
    missing = tmp_path / "nowhere" / "parser.py"
    with pytest.raises(StartupError) as caught:
        ToolParserManager.import_tool_parser(str(missing))
    assert str(caught.value) == (
        f"--tool-parser-plugin {str(missing)!r}: no such file ({missing}); pass the path of an existing .py file "
        "or an importable module name"
    )


def test_a_plugin_module_that_raises_import_error_is_a_startup_error(tmp_path, monkeypatch):
    (tmp_path / "plugin_broken_mod_xyz.py").write_text("raise ImportError('needs torch_fancy, which is missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(StartupError) as caught:
        ReasoningParserManager.import_reasoning_parser("plugin_broken_mod_xyz")
    assert str(caught.value) == (
        "--reasoning-parser-plugin 'plugin_broken_mod_xyz': importing it failed with ImportError: needs "
        "torch_fancy, which is missing; fix the plugin (or install what it imports) or drop the option"
    )
    assert isinstance(caught.value.__cause__, ImportError)


def test_a_plugin_file_that_fails_is_a_startup_error_and_not_left_half_loaded(tmp_path):
    path = tmp_path / "broken_file.py"
    path.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(StartupError) as caught:
        ToolParserManager.import_tool_parser(str(path))
    assert str(caught.value) == (
        f"--tool-parser-plugin {str(path)!r}: importing it failed with ModuleNotFoundError: No module named "
        "'no_such_dependency_xyz'; fix the plugin (or install what it imports) or drop the option"
    )
    assert not any(name.startswith("_asyncengine_parser_plugin_broken_file_") for name in sys.modules)


def test_an_unknown_plugin_module_is_a_startup_error():
    with pytest.raises(StartupError) as caught:
        ToolParserManager.import_tool_parser("no_such_plugin_module_xyz")
    assert str(caught.value) == (
        "--tool-parser-plugin 'no_such_plugin_module_xyz': importing it failed with ModuleNotFoundError: No "
        "module named 'no_such_plugin_module_xyz'; fix the plugin (or install what it imports) or drop the option"
    )


@pytest.mark.parametrize("value", ["", "   ", None])
def test_a_blank_plugin_value_is_a_startup_error(value):
    with pytest.raises(StartupError) as caught:
        ToolParserManager.import_tool_parser(value)
    assert str(caught.value) == (
        f"--tool-parser-plugin {value!r}: the value is blank; pass the path of a .py file or an importable "
        "module name"
    )


@pytest.mark.parametrize("value", [".", "-", "my-plugin"])
def test_a_value_that_is_neither_path_nor_module_is_a_startup_error(value):
    with pytest.raises(StartupError) as caught:
        ReasoningParserManager.import_reasoning_parser(value)
    assert str(caught.value) == (
        f"--reasoning-parser-plugin {value!r}: this is neither a path to a .py file nor a module name "
        "(dotted Python identifiers); pass one of those"
    )
