"""IO processors (E3) and per-request logits-processor arguments over HTTP (`vllm_xargs`, E6 and C4), in one
real multiprocess `asyncengine serve` on the default model (engine core and worker in processes of their
own) with two first-party distributions installed:

- asyncengine-io-processor-example (asyncengine.io_processor_plugins), chosen by --io-processor-plugin:
  POST /v1/io_process turns a list of items into prompts, generates them, and answers one result per item;
- asyncengine-logits-example, enabled through the option `--logits-processors` (C4) while the allow-list
  leaves its entry point out: it bans the token ids a request names in `vllm_xargs`.

Each plugin appends {"what", "pid", "role"} lines to AE_PLUGIN_RECORD: the IO processor's must name the
server's process, the frontend; the logits processor's apply must name a worker process. The wrong uses of
--io-processor-plugin fail start-up before the model loads, listing what is installed.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from support.server import ServerDidNotStart, start_server

pytestmark = pytest.mark.slow

DISTS = ("asyncengine-io-processor-example", "asyncengine-logits-example")
IO_PROCESSOR, LOGITS = "ae_example_items", "ae_banned_tokens"
LOGITS_CLASS = "ae_logits_example:BannedTokensProcessor"
PROMPT = "Once upon a time"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def env_with(plugin_target, **extra: str) -> dict[str, str]:
    """plugin_env's environment (that fixture is per test; the server here is shared by the module's tests)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ASYNCENGINE_PLUGINS", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join(str(plugin_target(name)) for name in DISTS)
    return {**env, **extra}


@pytest.fixture(scope="module")
def served(default_model_dir, plugin_target, tmp_path_factory):
    records = tmp_path_factory.mktemp("io-processor") / "records.jsonl"
    env = env_with(plugin_target, AE_PLUGIN_RECORD=str(records))
    server = start_server([str(default_model_dir), "--plugins", IO_PROCESSOR, "--io-processor-plugin", IO_PROCESSOR,
                           "--logits-processors", LOGITS_CLASS, "--distributed-executor-backend", "mp"], env=env)
    try:
        yield server, records
    finally:
        assert server.stop() == 0, server.stderr()[-3000:]


def where(records: Path, what: str) -> set[tuple[int, str]]:
    return {(line["pid"], line["role"]) for line in read_jsonl(records) if line["what"] == what}


@pytest.mark.extension_point("E3")
def test_io_processor_route_end_to_end_in_the_server_process(served):
    server, records = served
    url = server.base_url + "/io_process"
    items = ["the sky", "fresh grass"]
    status, body = post(url, {"data": {"items": items, "template": "The color of {item} is"}, "max_tokens": 4,
                              "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert body["object"] == "io_process" and body["plugin"] == IO_PROCESSOR
    results = body["data"]["results"]
    assert body["data"]["count"] == 2
    assert [r["prompt"] for r in results] == [f"The color of {item} is" for item in items]  # the items' order
    assert all(len(r["token_ids"]) == 4 and r["text"] and r["finish_reason"] == "length" for r in results)
    assert body["usage"]["completion_tokens"] == 8

    # The same prompt through /v1/completions gives the same greedy text: the route generated it for real.
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client:
        completion = client.completions.create(model=body["model"], prompt="The color of the sky is", max_tokens=4,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert completion.choices[0].text == results[0]["text"]

    # The plugin refuses bad data: a 400 in OpenAI's shape naming the plugin and the parameter...
    status, refused = post(url, {"data": {"items": []}})
    assert status == 400, refused
    error = refused["error"]
    assert error["param"] == "data.items" and error["code"] == "io_processor_refused"
    assert f"IO processor {IO_PROCESSOR!r} (" in error["message"] and "pre_process refused the request" in error[
        "message"] and "distribution asyncengine-io-processor-example" in error["message"]
    assert "non-empty list" in error["message"]
    # ... a body without data is the server's own 400, and the next request is served.
    status, missing = post(url, {"max_tokens": 2})
    assert (status, missing["error"]["param"]) == (400, "data")
    status, again = post(url, {"data": {"items": ["tea"]}, "max_tokens": 2})
    assert status == 200 and again["data"]["count"] == 1, again

    # pre_process (sync: a worker thread) and post_process (async: the event loop) ran in the server's process.
    here = {(server.process.pid, "frontend")}
    assert where(records, "io processor pre_process") == here
    assert where(records, "io processor post_process") == here


@pytest.mark.extension_point("E6", "C4")
def test_vllm_xargs_reach_the_logits_processor_through_the_openai_client(served):
    server, records = served
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client:
        model = client.models.list().data[0].id
        options = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}

        # The greedy continuation's token ids, as generated (the IO processor's results carry them).
        status, plain = post(server.base_url + "/io_process",
                             {"data": {"items": [PROMPT], "template": "{item}"}, "max_tokens": 4, "temperature": 0,
                              "ignore_eos": True})
        assert status == 200, plain
        greedy = plain["data"]["results"][0]
        unbanned = client.completions.create(**options, extra_body={"ignore_eos": True})
        assert unbanned.choices[0].text == greedy["text"]

        # Ban every token of the greedy continuation: the same request must take another path, none of them.
        banned = sorted(set(greedy["token_ids"]))
        xargs = {"vllm_xargs": {"banned_token_ids": banned}, "ignore_eos": True}
        result = client.completions.create(**options, extra_body=xargs)
        assert result.choices[0].text != greedy["text"]
        status, same = post(server.base_url + "/io_process",  # the same request, to see its token ids
                            {"data": {"items": [PROMPT], "template": "{item}"}, "max_tokens": 4, "temperature": 0,
                             **xargs})
        assert status == 200, same
        produced = same["data"]["results"][0]
        assert produced["text"] == result.choices[0].text and len(produced["token_ids"]) == 4
        assert not set(produced["token_ids"]) & set(banned), (produced["token_ids"], banned)

        # Chat completions carry them too: banning the greedy reply's tokens changes the reply.
        messages = [{"role": "user", "content": "Say hello."}]
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0)
        status, reply_tokens = post(server.url + "/tokenize", {"prompt": reply.choices[0].message.content,
                                                               "add_special_tokens": False})
        assert status == 200, reply_tokens
        other = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0,
                                               extra_body={"vllm_xargs": {"banned_token_ids": reply_tokens["tokens"]}})
        assert other.choices[0].message.content != reply.choices[0].message.content

        # An argument the processor refuses: a 400 naming the parameter path and the processor.
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(**options, extra_body={"vllm_xargs": {"banned_token_ids": [-1]}})
        error = refused.value.body
        assert error["param"] == "vllm_xargs.banned_token_ids", error
        assert f"logits processor {LOGITS_CLASS} refused vllm_xargs.banned_token_ids" in error["message"]
        # A value that cannot travel to the workers (msgpack holds 64-bit integers), and one vLLM's schema refuses.
        with pytest.raises(openai.BadRequestError) as too_big:
            client.completions.create(**options, extra_body={"vllm_xargs": {"seed_of_mine": 2**70}})
        assert too_big.value.body["param"] == "vllm_xargs" and "msgpack" in too_big.value.body["message"]
        with pytest.raises(openai.BadRequestError) as nested:
            client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                           extra_body={"vllm_xargs": {"deep": {"a": 1}}})
        assert nested.value.body["param"].startswith("vllm_xargs"), nested.value.body
    with urllib.request.urlopen(server.base_url + "/startup") as response:
        startup = json.loads(response.read())

    # The processor came through the option (C4), its entry point left out by the allow-list, and ran in a worker.
    entry_point = [r for r in startup if r["plugin"] == LOGITS and r["role"] == "frontend"]
    assert entry_point and all(r["outcome"] != "ok" for r in entry_point), entry_point
    applied = where(records, "logits processor apply")
    assert len(applied) == 1 and next(iter(applied))[0] != server.process.pid, applied
    assert next(iter(applied))[1] == "worker rank 0", applied


@pytest.mark.extension_point("E3")
def test_io_processor_names_that_cannot_be_used_fail_start_up_listing_the_installed(default_model_dir,
                                                                                    plugin_target):
    env = env_with(plugin_target)
    model = str(default_model_dir)
    with pytest.raises(ServerDidNotStart) as unknown:
        start_server([model, "--io-processor-plugin", "ae_no_such_processor"], env=env)
    assert unknown.value.returncode == 2
    assert ("--io-processor-plugin 'ae_no_such_processor' is not an installed IO processor; installed: "
            f"{IO_PROCESSOR} (asyncengine-io-processor-example 0.1.0)") in unknown.value.stderr
    with pytest.raises(ServerDidNotStart) as skipped:
        start_server([model, "--plugins", LOGITS, "--io-processor-plugin", IO_PROCESSOR], env=env)
    assert skipped.value.returncode == 2
    assert (f"--io-processor-plugin {IO_PROCESSOR!r} is installed, but the allow-list skips it (not allowed "
            "(--plugins does not name it)): name it in --plugins") in skipped.value.stderr
