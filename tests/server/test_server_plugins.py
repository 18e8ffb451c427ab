"""Plugins in a real multiprocess server: an endpoint plugin (route and background task), a stat-logger
plugin and two middlewares, from a distribution installed into a temporary target on PYTHONPATH. Each
records the process id and role its code ran in: all must be the server's own process, the frontend.
In the same server, an endpoint plugin that says override replaces a built-in route (from a second
distribution). A plugin route that clashes with a built-in one fails start-up naming the route. A tool-parser plugin file
and the think reasoning parser, in a server on the tiny Llama with a byte-level tokenizer: what the parsers
do does not depend on what the model says."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path

import openai
import pytest

from support.server import ServerDidNotStart, start_server
from support.tiny_tokenizer import save_tiny_tokenizer

pytestmark = pytest.mark.slow

TINY_OPTIONS = ["--skip-tokenizer-init", "--max-model-len", "512", "--kv-cache-memory-bytes", str(8 * 2**20)]


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_endpoint_stat_logger_and_middleware_plugins_run_in_the_frontend(tiny_model, plugin_env, tmp_path):
    records_file = tmp_path / "records.jsonl"
    # (one server for both distributions: a server start is the cost of this module)
    env = plugin_env("ae-plugin-server", "ae-plugin-route-clash", AE_PLUGIN_RECORD=str(records_file))
    server = start_server([str(tiny_model("llama").path), *TINY_OPTIONS, "--plugins",
                           "ae_server_hello,ae_server_stats,ae_override", "--middleware",
                           "ae_plugin_server.middleware:tag_response,ae_plugin_server.middleware:AsgiTag"],
                          env=env)
    try:
        with urllib.request.urlopen(server.url + "/hello") as response:
            assert json.loads(response.read())["hello"] == "from a plugin"
        # The endpoint plugin that says override replaces the built-in route.
        with urllib.request.urlopen(server.url + "/version") as response:
            assert json.loads(response.read()) == {"version": "from the override plugin"}
        with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client:
            raw = client.models.with_raw_response.list()
            assert raw.headers["x-ae-function-middleware"] == "ran"
            assert raw.headers["x-ae-asgi-middleware"] == "ran"
            completion = client.completions.create(model=str(tiny_model("llama").path), prompt=[5, 6, 7], max_tokens=6,
                                                   temperature=0, extra_body={"ignore_eos": True})
            assert completion.usage.completion_tokens == 6
        with urllib.request.urlopen(server.base_url + "/startup") as response:
            startup = json.loads(response.read())
    finally:
        assert server.stop() == 0, server.stderr()[-3000:]

    records = read_records(records_file)
    seen = {record["what"] for record in records}
    assert seen == {"endpoint route", "endpoint background task", "stat logger", "function middleware",
                    "asgi middleware"}
    assert {(record["pid"], record["role"]) for record in records} == {(server.process.pid, "frontend")}
    stats = [record for record in records if record["what"] == "stat logger"]
    assert stats[-1]["generation_tokens"] == 6  # it received every step of the request
    # The engine core is another process, and the report shows the plugins loading in the frontend only.
    core_pids = {r["pid"] for r in startup if r["role"] == "engine core"}
    assert core_pids and server.process.pid not in core_pids
    loaded = {(r["role"], r["plugin"]) for r in startup if r["group"] and r["outcome"] == "ok"}
    assert loaded == {("frontend", "ae_server_hello"), ("frontend", "ae_server_stats"), ("frontend", "ae_override")}


def test_an_endpoint_plugin_route_that_clashes_with_a_built_in_fails_start_up(tiny_model, plugin_env):
    env = plugin_env("ae-plugin-route-clash")
    with pytest.raises(ServerDidNotStart) as failed:
        start_server([str(tiny_model("llama").path), *TINY_OPTIONS, "--plugins", "ae_clash"], env=env)
    assert failed.value.returncode == 1
    assert ("endpoint plugin 'clash' adds the route POST /v1/completions, which is a built-in route: choose another "
            "path, or set override = True on the plugin to replace the built-in one") in failed.value.stderr



TOOL_PARSER_PLUGIN = '''
import json
from asyncengine.plugins_api import ExtractedToolCalls, ToolCall, ToolParser, ToolParserManager
from asyncengine.plugins_api import FunctionCall, new_tool_call_id


@ToolParserManager.register_module("always_weather")
class AlwaysWeather(ToolParser):
    """Whatever the model says, it asks for the weather: a parser plugin loaded from a file."""

    def extract_tool_calls(self, model_output, request):
        call = ToolCall(id=new_tool_call_id(), function=FunctionCall(name="get_weather",
                        arguments=json.dumps({"said": model_output})))
        return ExtractedToolCalls(tools_called=True, tool_calls=[call], content=None)

    def extract_tool_calls_streaming(self, previous_text, current_text, delta_text, request):
        return None
'''


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-chat") / "llama"
    shutil.copytree(tiny_model("llama").path, directory)  # a copy: the shared tiny model stays tokenizer-less
    save_tiny_tokenizer(directory)
    return directory


CHAT_OPTIONS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(8 * 2**20)]


def test_a_tool_parser_plugin_file_and_the_think_reasoning_parser(chat_model, tmp_path):
    plugin = tmp_path / "weather_parser.py"
    plugin.write_text(TOOL_PARSER_PLUGIN)
    server = start_server([str(chat_model), *CHAT_OPTIONS, "--tool-parser-plugin", str(plugin), "--tool-call-parser",
                           "always_weather", "--enable-auto-tool-choice", "--reasoning-parser", "think"])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    try:
        with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client:
            response = client.chat.completions.create(model=str(chat_model), messages=messages, tools=tools,
                                                      max_tokens=8, temperature=0)
            choice = response.choices[0]
            assert choice.finish_reason == "tool_calls" or choice.finish_reason == "length"
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather" and "said" in json.loads(call.function.arguments)
            streamed = list(client.chat.completions.create(model=str(chat_model), messages=messages,
                                                           tools=tools, max_tokens=8, temperature=0, stream=True))
            calls = [c for chunk in streamed for c in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
            assert [c.function.name for c in calls] == ["get_weather"]  # sent at the end, when the parser held it
            plain = client.chat.completions.create(model=str(chat_model), messages=messages, max_tokens=8,
                                                   temperature=0)
            # No tools in the request: the tool parser stays out; the think parser finds no tags: all content.
            assert plain.choices[0].message.tool_calls == [] and plain.choices[0].message.content
    finally:
        assert server.stop() == 0, server.stderr()[-3000:]


def test_a_tool_parser_plugin_that_cannot_load_fails_start_up(chat_model, tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(ServerDidNotStart) as failed:
        start_server([str(chat_model), *CHAT_OPTIONS, "--tool-parser-plugin", str(missing), "--tool-call-parser", "x"])
    assert failed.value.returncode == 1
    assert "--tool-parser-plugin" in failed.value.stderr and str(missing) in failed.value.stderr
    assert os.path.basename(str(missing)) in failed.value.stderr
