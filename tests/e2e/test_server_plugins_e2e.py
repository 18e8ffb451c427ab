"""The first-party server-side plugins, installed as real distributions, in one real multiprocess
`asyncengine serve` on the default model:

- asyncengine-endpoint-example (asyncengine.endpoint_plugins, opt-in): GET /example/stats, fed by a
  background task in the server's task group that polls the scheduler's stats; and its HTTP middleware,
  named by the config hook --middleware (C8), adding X-Served-By to every response;
- asyncengine-stat-logger-example (asyncengine.stat_logger_plugins): counts tokens and finished
  requests, and writes a JSON summary line from log();
- asyncengine-parsers-example (asyncengine.general_plugins): registers the tool parser `example_fn`
  and the reasoning parser `example_brackets`, chosen with --tool-call-parser / --reasoning-parser.

The model does not write the parsers' syntax, so this shows what it honestly can: the registries were
filled in the server's process (else it would not start), the chat route ran both parsers on real
outputs, whole and streamed, and passed text without their syntax through unchanged (their parsing
itself is the unit tests' job: plugins/asyncengine-parsers-example/tests).

Each plugin appends {"what", "pid", "role"} lines to AE_PLUGIN_RECORD: they must name the server's
process, the frontend. The server exits 0 on SIGTERM.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from support.server import start_server

pytestmark = pytest.mark.slow

DISTS = ("asyncengine-endpoint-example", "asyncengine-stat-logger-example", "asyncengine-parsers-example")
ENDPOINT, STAT_LOGGER, PARSERS = "ae_example_stats_endpoint", "ae_example_stat_logger", "ae_example_parsers"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def get_json(url: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())


def wait_for(predicate, timeout: float = 30.0, what: str = "a condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.mark.extension_point("E1", "E4", "E5", "R7", "R8", "C8")
def test_endpoint_stat_logger_and_parser_plugins_in_a_real_server(default_model_dir, plugin_env, tmp_path):
    records_file, summary_file = tmp_path / "records.jsonl", tmp_path / "summary.jsonl"
    env = plugin_env(*DISTS, AE_PLUGIN_RECORD=str(records_file), AE_EXAMPLE_STATS_FILE=str(summary_file))
    model = str(default_model_dir)
    server = start_server([model, "--plugins", f"{ENDPOINT},{STAT_LOGGER},{PARSERS}",
                           "--tool-call-parser", "example_fn", "--enable-auto-tool-choice",
                           "--reasoning-parser", "example_brackets", "--stats-log-interval", "0.2",
                           "--middleware", "ae_endpoint_example.middleware:served_by"], env=env)
    try:
        with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client:
            # 1. A completion long enough to be running across several 0.2 s polls.
            completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=64,
                                                   temperature=0, extra_body={"ignore_eos": True})
            assert completion.usage.completion_tokens == 64

            # The endpoint plugin's route, and what its background task saw.
            watched = get_json(server.url + "/example/stats")
            assert watched["polling"] and watched["errors"] == 0, watched
            assert watched["max_running"] >= 1 and watched["busy_polls"] >= 1, watched
            assert watched["pid"] == server.process.pid

            # The middleware (C8) wrapped the built-in routes and the plugin's.
            for path in ("/v1/models", "/example/stats", "/health"):
                with urllib.request.urlopen(server.url + path) as response:
                    assert response.headers["X-Served-By"] == f"asyncengine pid {server.process.pid}", path

            # The stat logger's summary line once it saw the request finish: its counts are the usage's.
            def finished_summary():
                return next((line for line in read_jsonl(summary_file) if line["finished_requests"] >= 1), None)

            summary = wait_for(finished_summary, what="the stat logger's summary of the finished request")
            assert summary["finished_requests"] == 1 and summary["finish_reasons"] == {"length": 1}
            assert summary["generation_tokens"] == completion.usage.completion_tokens
            assert summary["finished_generation_tokens"] == completion.usage.completion_tokens
            assert summary["prompt_tokens"] == completion.usage.prompt_tokens
            assert (summary["pid"], summary["role"]) == (server.process.pid, "frontend")

            # 2. The parsers, on the model's real output. Reference: the raw text of the same prompt.
            prompt = get_json(server.url + "/tokenize", {"messages": MESSAGES})
            raw = client.completions.create(model=model, prompt=prompt["tokens"], max_tokens=24, temperature=0)
            raw_text = raw.choices[0].text
            assert raw_text and not raw_text.lstrip().startswith("[[")
            assert not any(line.lstrip().startswith("FUNCTION") for line in raw_text.split("\n"))

            # Without tools: only the reasoning parser runs; no leading [[: it is all content, unchanged.
            plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0)
            assert plain.usage.prompt_tokens == prompt["count"]
            assert plain.choices[0].message.content == raw_text
            assert getattr(plain.choices[0].message, "reasoning_content", None) is None

            # With tools: the tool parser runs too; no call line, so no tool calls and the content stays.
            whole = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=24,
                                                   temperature=0)
            choice = whole.choices[0]
            assert choice.message.tool_calls == [] and choice.message.content
            assert choice.finish_reason in ("stop", "length")
            assert getattr(choice.message, "reasoning_content", None) is None
            streamed = list(client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                                           max_tokens=24, temperature=0, stream=True))
            deltas = [chunk.choices[0].delta for chunk in streamed if chunk.choices]
            assert "".join(delta.content or "" for delta in deltas) == choice.message.content
            assert not any(delta.tool_calls for delta in deltas)
            assert not any(getattr(delta, "reasoning_content", None) for delta in deltas)

        startup = get_json(server.base_url + "/startup")
    finally:
        assert server.stop() == 0, server.stderr()[-3000:]

    # Where the plugins loaded: the endpoint and the stat logger in the frontend only; the parsers'
    # general plugin in every process (general plugins load everywhere), the frontend included.
    loaded = {}
    for record in startup:
        if record["group"] and record["outcome"] == "ok":
            loaded.setdefault(record["plugin"], set()).add(record["role"])
    assert loaded[ENDPOINT] == {"frontend"} and loaded[STAT_LOGGER] == {"frontend"}
    assert "frontend" in loaded[PARSERS] and "engine core" in loaded[PARSERS]

    records = read_jsonl(records_file)
    by_what: dict[str, set] = {}
    for record in records:
        by_what.setdefault(record["what"], set()).add((record["pid"], record["role"]))
    here = {(server.process.pid, "frontend")}
    for what in ("endpoint attach", "endpoint background task", "endpoint route", "middleware",  # endpoint dist
                 "stat logger record", "stat logger log",  # the stat logger
                 "tool parser extract_tool_calls", "tool parser extract_tool_calls_streaming",  # the parsers
                 "reasoning parser extract_reasoning", "reasoning parser extract_reasoning_streaming"):
        assert by_what.get(what) == here, (what, by_what)
    registered = by_what["parsers registered"]
    assert (server.process.pid, "frontend") in registered
    assert all(pid != server.process.pid and role != "frontend" for pid, role in registered - here), registered
    assert set(by_what) == {"endpoint attach", "endpoint background task", "endpoint route", "middleware",
                            "stat logger record",
                            "stat logger log", "tool parser extract_tool_calls",
                            "tool parser extract_tool_calls_streaming", "reasoning parser extract_reasoning",
                            "reasoning parser extract_reasoning_streaming", "parsers registered"}
