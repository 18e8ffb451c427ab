"""Recorded model texts for the built-in tool-call and reasoning parsers: what each model family writes
(the formats of the models' chat templates and of vLLM's parser tests), and what a parser must read
in them. tests/server/test_parser_formats.py runs every sample whole and streamed.

A ToolSample's `calls` are (name, arguments as a dict); `content` is the whole response's content.
`broken` samples are not calls: the whole text comes back as content; a stream sends it as content too,
unless the break shows only inside a call it has begun (`stream_begins`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolSample:
    parser: str
    label: str
    text: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    content: str | None = None
    tools: list[dict[str, Any]] | None = None  # the request's tools, for parsers that read their schemas
    broken: bool = False  # not the format: no calls, the whole text is content
    # For a broken text: the calls a stream may have begun before the break showed, when its pieces were
    # small enough (it cannot take them back; it then sends the rest of the text as content).
    stream_begins: list[str] = field(default_factory=list)


@dataclass
class ReasoningSample:
    parser: str
    label: str
    text: str
    reasoning: str | None
    content: str | None
    chat_template_kwargs: dict[str, Any] | None = None


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}

TYPED_TOOL = {"type": "function", "function": {"name": "book_trip", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "nights": {"type": "integer"}, "budget": {"type": "number"},
        "refundable": {"type": "boolean"}, "stops": {"type": "array", "items": {"type": "string"}},
        "extras": {"type": "object"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "code": {"type": "string"}, "ratio": {"type": ["number", "null"]}}}}}

TOOL_SAMPLES = [
    # -- llama3_json: Llama 3.1 / 3.2 / 3.3 with vLLM's JSON tool template -----------------------------
    ToolSample("llama3_json", "one call after <|python_tag|>",
               '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "celsius"}}',
               [("get_weather", {"city": "San Francisco", "unit": "celsius"})]),
    ToolSample("llama3_json", "bare JSON, arguments key",
               '{"name": "searchTool", "arguments": {"query": "test {value} [complex]", "limit": 10}}',
               [("searchTool", {"query": "test {value} [complex]", "limit": 10})]),
    ToolSample("llama3_json", "three calls joined by semicolons",
               '{"name": "searchTool", "parameters": {"query": "test1"}}; '
               '{"name": "getOpenIncidentsTool", "parameters": {}}; '
               '{"name": "searchTool", "parameters": {"query": "test2"}}',
               [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}), ("searchTool", {"query": "test2"})]),
    ToolSample("llama3_json", "text before the python tag, escapes and nesting",
               'Let me look that up.\n<|python_tag|>{"name": "parserTool", "parameters": '
               '{"text": "He said \\"Hello {world}\\"", "config": {"pool": {"size": 10}}}}',
               [("parserTool", {"text": 'He said "Hello {world}"', "config": {"pool": {"size": 10}}})],
               content="Let me look that up."),
    ToolSample("llama3_json", "a call then an answer", '{"name": "get_time", "parameters": {"tz": "UTC"}}\n\nDone.',
               [("get_time", {"tz": "UTC"})], content="Done."),
    ToolSample("llama3_json", "plain answer", "The capital of France is Paris.", content="The capital of France is Paris."),
    ToolSample("llama3_json", "a JSON answer is not a call", '{"city": "Paris", "country": "France"}', broken=True),
    ToolSample("llama3_json", "a name without parameters is not a call", '{"name": "Paris"}', broken=True),
    ToolSample("llama3_json", "invalid JSON", '{"name": "invalidTool", "parameters": {invalid json}}', broken=True),

    # -- mistral: [TOOL_CALLS], before v11 (a JSON list) and from v11 (name{args}) ---------------------
    ToolSample("mistral", "pre-v11 list of one",
               '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", '
               '"unit": "celsius"}}]',
               [("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})]),
    ToolSample("mistral", "pre-v11 arguments before the name",
               '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]',
               [("get_age", {"name": "John Doe"})]),
    ToolSample("mistral", "pre-v11 two calls after content",
               'Hello[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, '
               '{"name": "get_current_weather", "arguments":{"city": "Dallas", "state": "TX", "unit": "fahrenheit"}}]',
               [("add", {"a": 3.5, "b": 4}), ("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})],
               content="Hello"),
    ToolSample("mistral", "v11 one call", '[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}',
               [("add_this_and_that", {"a": 3.5, "b": 4})]),
    ToolSample("mistral", "v11 two calls",
               '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}',
               [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})]),
    ToolSample("mistral", "v13 [ARGS] and [CALL_ID]",
               'I will check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
               '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "Europe/Paris"}',
               [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})], content="I will check."),
    ToolSample("mistral", "plain answer with brackets", "See [1] and [TOOL] for details.",
               content="See [1] and [TOOL] for details."),
    ToolSample("mistral", "not JSON after the marker", "[TOOL_CALLS] not json at all", broken=True),

    # -- pythonic: Llama 3.2 / Llama 4 / ToolACE --------------------------------------------------------
    ToolSample("pythonic", "one call", '[get_weather(city="San Francisco", metric="celsius")]',
               [("get_weather", {"city": "San Francisco", "metric": "celsius"})]),
    ToolSample("pythonic", "two calls, every literal",
               "[register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, "
               "role=None, passed_test=True, aliases=['John', 'Johnny'], scores=(1, -2.5)), get_weather(city='Paris')]",
               [("register_user", {"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"},
                                   "role": None, "passed_test": True, "aliases": ["John", "Johnny"],
                                   "scores": [1, -2.5]}),
                ("get_weather", {"city": "Paris"})]),
    ToolSample("pythonic", "no arguments, strings with brackets and commas",
               '[refresh(), search(query="a, b (c) [d]", escaped="it\'s \\"quoted\\"")]',
               [("refresh", {}), ("search", {"query": "a, b (c) [d]", "escaped": "it's \"quoted\""})]),
    ToolSample("llama4_pythonic", "Llama 4 wrapped list",
               '<|python_start|>[get_weather(city="Boston", days=3)]<|python_end|>',
               [("get_weather", {"city": "Boston", "days": 3})]),
    ToolSample("pythonic", "plain answer", "Paris is the capital of France.", content="Paris is the capital of France."),
    ToolSample("pythonic", "a footnote list is not calls", "[1] Paris, see the atlas.", broken=True),
    ToolSample("pythonic", "positional arguments are not calls", '[get_weather("Paris")]', broken=True),

    # -- qwen3_coder: Qwen3-Coder's XML, typed by the request's schema ----------------------------------
    ToolSample("qwen3_coder", "one call after content",
               "I'll check the weather for you.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n"
               "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n"
               "</function>\n</tool_call>",
               [("get_weather", {"city": "Dallas", "days": 3, "unit": "fahrenheit"})],
               content="I'll check the weather for you.", tools=[WEATHER_TOOL]),
    ToolSample("qwen3_coder", "two calls",
               "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
               "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n"
               "</parameter>\n</function>\n</tool_call>",
               [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})], tools=[WEATHER_TOOL]),
    ToolSample("qwen3_coder", "every type converted by the schema",
               "<tool_call>\n<function=book_trip>\n<parameter=city>\nNew York\n</parameter>\n"
               "<parameter=nights>\n4\n</parameter>\n<parameter=budget>\n1250.50\n</parameter>\n"
               "<parameter=refundable>\nTrue\n</parameter>\n<parameter=stops>\n[\"Boston\", \"DC\"]\n</parameter>\n"
               "<parameter=extras>\n{'breakfast': true}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
               "<parameter=code>\n007\n</parameter>\n<parameter=ratio>\nNone\n</parameter>\n"
               "<parameter=unlisted>\n42\n</parameter>\n</function>\n</tool_call>",
               [("book_trip", {"city": "New York", "nights": 4, "budget": 1250.5, "refundable": True,
                               "stops": ["Boston", "DC"], "extras": "{'breakfast': true}", "note": None, "code": "007",
                               "ratio": None, "unlisted": "42"})],
               tools=[TYPED_TOOL]),
    ToolSample("qwen3_coder", "a multi-line value and no schema",
               "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n<parameter=content>\n"
               "def f(x):\n    return x < 2\n\n</parameter>\n</function>\n</tool_call>",
               [("write_file", {"path": "/tmp/a.py", "content": "def f(x):\n    return x < 2\n"})]),
    ToolSample("qwen3_coder", "plain answer", "Use <b>bold</b> for emphasis.", content="Use <b>bold</b> for emphasis."),
    ToolSample("qwen3_coder", "no function tag", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", broken=True),

    # -- deepseek_v3 / deepseek_v31 -----------------------------------------------------------------------
    ToolSample("deepseek_v3", "one call",
               "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
               '{"city": "Tokyo", "unit": "celsius"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
               [("get_weather", {"city": "Tokyo", "unit": "celsius"})]),
    ToolSample("deepseek_v3", "two calls after content",
               "Let me check the weather for you.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
               'get_weather\n```json\n{"city": "Tokyo", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n'
               "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search_hotels\n```json\n"
               '{"location": "Tokyo", "check_in": "2025-01-15", "escaped": "He said \\"hello\\"\\nC:\\\\Users"}\n```'
               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
               [("get_weather", {"city": "Tokyo", "unit": "celsius"}),
                ("search_hotels", {"location": "Tokyo", "check_in": "2025-01-15",
                                   "escaped": 'He said "hello"\nC:\\Users'})],
               content="Let me check the weather for you."),
    ToolSample("deepseek_v3", "empty arguments",
               "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_time\n```json\n{}\n```"
               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
               [("get_current_time", {})]),
    ToolSample("deepseek_v3", "plain answer", "How can I help you today? I can check weather for you.",
               content="How can I help you today? I can check weather for you."),
    ToolSample("deepseek_v3", "unclosed JSON",
               "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
               '{"city": "Tokyo"\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', broken=True, stream_begins=["get_weather"]),
    ToolSample("deepseek_v31", "two calls",
               '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Tokyo"}<｜tool▁call▁end｜>'
               '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "Asia/Tokyo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
               [("get_weather", {"city": "Tokyo"}), ("get_time", {"tz": "Asia/Tokyo"})]),

    # -- granite: Granite 3.0 (<|tool_call|>) and 3.1 (<tool_call>) -------------------------------------
    ToolSample("granite", "3.0 token, one call",
               '<|tool_call|> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]',
               [("get_weather", {"city": "Tokyo"})]),
    ToolSample("granite", "3.1 string, arguments before names, two calls",
               '<tool_call>[{"arguments": {"city": "Tokyo"}, "name": "get_weather"}, '
               '{"arguments": {"timezone": "Asia/Tokyo"}, "name": "get_time"}]',
               [("get_weather", {"city": "Tokyo"}), ("get_time", {"timezone": "Asia/Tokyo"})]),
    ToolSample("granite", "pretty-printed types",
               '<tool_call> [{\n  "name": "test_function",\n  "arguments": {\n    "string_field": "hello",\n'
               '    "int_field": 42,\n    "float_field": 3.14,\n    "bool_field": true,\n    "null_field": null,\n'
               '    "array_field": ["a", "b", "c"],\n    "object_field": {"nested": "value"},\n    "empty_array": [],\n'
               '    "unicode": "emoji: 🎉"\n  }\n}]',
               [("test_function", {"string_field": "hello", "int_field": 42, "float_field": 3.14, "bool_field": True,
                                   "null_field": None, "array_field": ["a", "b", "c"],
                                   "object_field": {"nested": "value"}, "empty_array": [], "unicode": "emoji: 🎉"})]),
    ToolSample("granite", "content before the marker",
               'Let me check the weather for you.\n<|tool_call|> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]',
               [("get_weather", {"city": "Tokyo"})], content="Let me check the weather for you."),
    ToolSample("granite", "plain answer", "This is a regular response without any tool calls.",
               content="This is a regular response without any tool calls."),
    ToolSample("granite", "not a list", '<|tool_call|> {"name": "func", "arguments": {}}', broken=True),
    ToolSample("granite", "string arguments that are not an object",
               '<|tool_call|> [{"name": "func", "arguments": "not a dict"}]', broken=True),

    # -- internlm: InternLM2 / 2.5 -----------------------------------------------------------------------
    ToolSample("internlm", "one call",
               '<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Tokyo"}}<|action_end|>',
               [("get_weather", {"city": "Tokyo"})]),
    ToolSample("internlm", "content before, arguments key, pretty-printed",
               "Let me check the weather for you. <|action_start|><|plugin|>{\n  \"name\": \"get_weather\",\n"
               "  \"arguments\": {\n    \"city\": \"Tokyo\",\n    \"days\": [1, 2]\n  }\n}<|action_end|>",
               [("get_weather", {"city": "Tokyo", "days": [1, 2]})], content="Let me check the weather for you."),
    ToolSample("internlm", "the closing marker stopped the output",
               '<|action_start|><|plugin|>{"name": "refresh", "parameters": {}}',
               [("refresh", {})]),
    ToolSample("internlm", "plain answer", "This is a regular response without any tool calls.",
               content="This is a regular response without any tool calls."),
    ToolSample("internlm", "not JSON", "<|action_start|><|plugin|>not json<|action_end|>", broken=True),

    # -- hermes / json_tags: Hermes 2 Pro, Qwen2.5 --------------------------------------------------------
    ToolSample("hermes", "Qwen2.5 two calls",
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
               [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]),
]

REASONING_SAMPLES = [
    # -- deepseek_r1: DeepSeek-R1 and QwQ; the template opens <think> in the prompt ----------------------
    ReasoningSample("deepseek_r1", "template opened the tag",
                    "Okay, 9.11 vs 9.8: compare tenths, 1 < 8.\n</think>\n\n9.8 is larger.",
                    "Okay, 9.11 vs 9.8: compare tenths, 1 < 8.\n", "\n\n9.8 is larger."),
    ReasoningSample("deepseek_r1", "model wrote the tag", "<think>\nSimple: 2 + 2 = 4.\n</think>\n\nThe answer is 4.",
                    "\nSimple: 2 + 2 = 4.\n", "\n\nThe answer is 4."),
    ReasoningSample("deepseek_r1", "cut off while thinking", "Let me think about <b>this</b> step by step",
                    "Let me think about <b>this</b> step by step", None),
    ReasoningSample("deepseek_r1", "empty thinking", "<think>\n\n</think>\n\nHello!", "\n\n", "\n\nHello!"),
    ReasoningSample("deepseek_r1", "closed with nothing after", "All done.</think>", "All done.", None),
    # -- qwen3 ------------------------------------------------------------------------------------------
    ReasoningSample("qwen3", "thinking on (default)", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
                    "\nThe user greets me.\n", "\n\nHello! How can I help?"),
    ReasoningSample("qwen3", "thinking off: all content", "Hello! How can I help?", None, "Hello! How can I help?",
                    {"enable_thinking": False}),
    ReasoningSample("qwen3", "thinking off keeps a stray tag as content", "a </think> b", None, "a </think> b",
                    {"enable_thinking": False}),
    ReasoningSample("qwen3", "thinking on, tool call before </think>",
                    "I need the weather.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>",
                    "I need the weather.\n",
                    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                    "</tool_call>", {"enable_thinking": True}),
    ReasoningSample("qwen3", "a <tool_call> mention inside the thinking", "Maybe a <tool_call> helps.\n</think>\n\nNo.",
                    "Maybe a <tool_call> helps.\n", "\n\nNo."),
    # -- granite: Granite 3.2 with thinking ---------------------------------------------------------------
    ReasoningSample("granite", "both sections",
                    "Here is my thought process:\nThe user wants a haiku. Here is a plan.\n"
                    "Here is my response:\nAutumn moonlight...",
                    "\nThe user wants a haiku. Here is a plan.\n", "\nAutumn moonlight..."),
    ReasoningSample("granite", "Here's variants", "Here's my thought process: short. Here's my response: long.",
                    " short. ", " long."),
    ReasoningSample("granite", "no thinking: all content", "Here are three facts about Mars.", None,
                    "Here are three facts about Mars."),
    ReasoningSample("granite", "cut off while thinking", "Here is my thought process:\nStep one", "\nStep one", None),
]
