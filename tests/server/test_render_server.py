"""The render server (asyncengine/server/render_server.py; vLLM's `vllm launch render`): the API without an
engine, on the tiny Llama with a byte-level tokenizer and a ChatML template.

- in this process (Quart's test client), beside a full server on the same model: /tokenize, /detokenize,
  /v1/models and the render routes answer exactly what the full server answers (and what the tokenizer
  itself gives); the render routes answer vLLM's GenerateRequest shape, with the engine's own checks
  (a prompt too long for the context is the same 400); generation and pooling routes answer 503 with
  code no_engine; no engine core runs (no thread, no child process), and tokenizing stays off the event
  loop (the loop guard);
- an endpoint plugin of ours is served with no engine client (`serve(None, ...)`, as vLLM's render
  server calls init_state(None, ...)), and one whose required_tasks leave out "render" fails start-up
  naming it (vLLM's FastAPI form: tests/e2e/test_vllm_shaped_endpoint.py);
- as a real subprocess, `asyncengine launch render MODEL`, driven by the official openai client and urllib;
  over HTTP/2 cleartext, DATA after an early 415 ends only its connection (issue 30, item 1).
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import urllib.error
import urllib.parse
import urllib.request
from contextlib import asynccontextmanager

import msgspec
import openai
import pytest

from asyncengine import AsyncEngine
from asyncengine.errors import StartupError
from asyncengine.interfaces.endpoint import EndpointPlugin
from asyncengine.server.app import create_app
from asyncengine.server.config import ServerConfig
from asyncengine.server.render_server import NoEngineError, RenderClient
from support.http2 import PRIOR_KNOWLEDGE, UPGRADE, h2c_request, send_then_data_after_the_answer
from support.server import start_server
# The tiny chat model (the tiny Llama with a byte-level tokenizer) and trio with the loop guard, as there.
from test_chat_rendering import anyio_backend, chat_model  # noqa: F401 (pytest fixtures)

pytestmark = pytest.mark.anyio

OPTIONS = dict(max_model_len=128, served_model_name="tiny-chat")
HELLO = [{"role": "user", "content": "hi there"}]


@asynccontextmanager
async def render_client(chat_model, server_config: ServerConfig | None = None, **options):
    async with RenderClient.start(model=str(chat_model), **OPTIONS, **options) as client:
        app = create_app(client, server_config or ServerConfig())
        async with app.test_app() as running:
            yield client, running.test_client()


async def post(client, path: str, body: dict) -> tuple[int, object]:
    response = await client.post(path, data=msgspec.json.encode(body), headers={"Content-Type": "application/json"})
    return response.status_code, msgspec.json.decode(await response.get_data())


CALLS = [
    ("/tokenize", {"prompt": "hello, world"}),
    ("/tokenize", {"messages": HELLO, "add_generation_prompt": True}),
    ("/detokenize", {"tokens": [74, 71, 78, 78, 81]}),
    ("/v1/completions/render", {"prompt": "hello", "max_tokens": 5, "temperature": 0.5}),
    ("/v1/completions/render", {"prompt": ["one", "two"], "stream": True}),
    ("/v1/completions/render", {"prompt": [[5, 6, 7], [8, 9]], "seed": 3}),
    ("/v1/chat/completions/render", {"messages": HELLO, "max_tokens": 4, "top_p": 0.25}),
    ("/v1/chat/completions/render", {"messages": HELLO, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions/render", {"prompt": "x" * 130}),  # longer than max_model_len: the engine's 400
    ("/v1/chat/completions/render", {"model": "another", "messages": HELLO}),  # an unknown model: 404
]


def _without_ids(status: int, body: object) -> tuple[int, object]:
    """The answer with the request ids (fresh per request) left out."""
    items = body if isinstance(body, list) else [body]
    for item in items:
        if isinstance(item, dict):
            item.pop("request_id", None)
    return status, body


async def test_the_render_server_answers_as_the_full_server_and_runs_no_engine(chat_model):
    async with AsyncEngine.start(model=str(chat_model), kv_cache_memory_bytes=8 * 2**20, **OPTIONS) as engine:
        app = create_app(engine, ServerConfig())
        async with app.test_app() as running:
            full = running.test_client()
            expected = [_without_ids(*await post(full, path, body)) for path, body in CALLS]
            models = msgspec.json.decode(await (await full.get("/v1/models")).get_data())
            generated = await post(full, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2})
    assert generated[0] == 200, generated  # the full server generates; the render server does not

    threads, children = {t.ident for t in threading.enumerate()}, multiprocessing.active_children()
    async with render_client(chat_model) as (client, render):
        answers = [_without_ids(*await post(render, path, body)) for path, body in CALLS]
        render_models = msgspec.json.decode(await (await render.get("/v1/models")).get_data())
        refused = {path: await post(render, path, body) for path, body in [
            ("/v1/chat/completions", {"messages": HELLO}), ("/v1/completions", {"prompt": "hi"}),
            ("/v1/embeddings", {"input": "hi"}), ("/v1/io_process", {"data": "hi"})]}
        health = (await render.get("/health")).status_code
        metrics = (await render.get("/metrics")).status_code
        with pytest.raises(NoEngineError, match="needs an engine"):
            await client.collective_rpc("describe")
        with pytest.raises(NoEngineError, match="needs an engine"):
            async for _ in client.generate("hi"):
                pass
        # No engine core: no child process, and no thread but the tokenizer pool's (anyio's workers).
        assert multiprocessing.active_children() == children
        new_threads = [t.name for t in threading.enumerate() if t.ident not in threads]
        assert all(name.startswith("AnyIO worker thread") for name in new_threads), new_threads

    for (path, body), answer, reference in zip(CALLS, answers, expected):
        assert answer == reference, (path, body)
    assert [status for status, _ in answers] == [200] * 8 + [400, 404]
    assert answers[2][1] == {"prompt": "hello"}
    assert [r["token_ids"] for r in answers[5][1]] == [[5, 6, 7], [8, 9]]
    assert render_models["data"][0]["id"] == models["data"][0]["id"] == "tiny-chat"
    assert {k: v for k, v in render_models["data"][0].items() if k != "created"} == \
        {k: v for k, v in models["data"][0].items() if k != "created"}
    for path, (status, body) in refused.items():
        assert status == 503 and body["error"]["code"] == "no_engine", (path, body)
        assert "asyncengine serve" in body["error"]["message"]
    assert (health, metrics) == (200, 200)


async def test_the_render_routes_are_what_the_tokenizer_and_the_template_give(chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_model))
    chat_text = tokenizer.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
    async with render_client(chat_model) as (_, render):
        status, chat = await post(render, "/v1/chat/completions/render",
                                  {"model": "tiny-chat", "messages": HELLO, "max_tokens": 4, "temperature": 0.3})
        status_c, completions = await post(render, "/v1/completions/render", {"prompt": ["ab", "cd"]})
        status_t, tokenized = await post(render, "/tokenize", {"prompt": "hello"})
        status_d, detokenized = await post(render, "/detokenize", {"tokens": tokenized["tokens"]})
    assert status == 200, chat
    # vLLM's GenerateRequest shape.
    assert set(chat) == {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                         "stream_options", "cache_salt", "priority", "kv_transfer_params"}
    assert chat["request_id"].startswith("chatcmpl-")
    assert chat["token_ids"] == tokenizer.encode(chat_text, add_special_tokens=False)
    assert chat["model"] == "tiny-chat" and chat["stream"] is False and chat["features"] is None
    assert chat["sampling_params"]["max_tokens"] == 4 and chat["sampling_params"]["temperature"] == 0.3
    assert status_c == 200 and [c["token_ids"] for c in completions] == [tokenizer.encode("ab"), tokenizer.encode("cd")]
    # Without max_tokens the bound is the completion route's default, 16.
    assert [c["sampling_params"]["max_tokens"] for c in completions] == [16, 16]
    assert status_t == 200 and tokenized["tokens"] == tokenizer.encode("hello")
    assert status_d == 200 and detokenized == {"prompt": "hello"}


class _Watcher(EndpointPlugin):
    """Our form: attach(app) adds a route that says which client serve() was given."""

    name = "watcher"

    def __init__(self) -> None:
        self.clients: list[object] = []

    def attach(self, app) -> None:
        @app.route("/watcher")
        async def watcher():
            return {"client": repr(self.clients)}

    async def serve(self, engine_client, task_status) -> None:
        self.clients.append(engine_client)
        task_status.started()


class _NeedsGenerate(_Watcher):
    name = "needs_generate"
    required_tasks = ("generate",)


async def test_endpoint_plugins_get_no_engine_client_and_must_accept_render(chat_model):
    watcher = _Watcher()
    async with RenderClient.start(model=str(chat_model), **OPTIONS) as client:
        client.plugins.endpoints.append(watcher)
        app = create_app(client, ServerConfig())
        async with app.test_app() as running:
            response = await running.test_client().get("/watcher")
            assert response.status_code == 200
            assert msgspec.json.decode(await response.get_data()) == {"client": "[None]"}

        client.plugins.endpoints[:] = [_NeedsGenerate()]
        with pytest.raises(StartupError) as refused:
            create_app(client, ServerConfig())
    message = str(refused.value)
    assert "endpoint plugin 'needs_generate'" in message
    assert "requires one of the tasks generate, and this server serves render" in message
    assert "asyncengine serve" in message


def test_launch_render_serves_over_http(chat_model):
    """The real command: `asyncengine launch render MODEL`, with the openai client and urllib."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_model))
    server = start_server([str(chat_model), "--served-model-name", "tiny-chat", "--max-model-len", "128",
                           "--api-key", "k"], command=("launch", "render"))
    try:
        assert "(a render server: no engine)" in server.stdout_path.read_text()
        client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-chat"]
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="tiny-chat", messages=HELLO, max_tokens=2)
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "no_engine"

        def call(path: str, body: dict, key: str = "k") -> dict:
            request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())

        tokens = call("/tokenize", {"prompt": "hello"})["tokens"]
        rendered = call("/v1/chat/completions/render", {"messages": HELLO})
        with pytest.raises(urllib.error.HTTPError) as unauthorized:
            call("/tokenize", {"prompt": "hello"}, key="no")
        assert unauthorized.value.code == 401
        assert tokens == tokenizer.encode("hello")
        assert rendered["token_ids"] == tokenizer.encode(
            tokenizer.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True), add_special_tokens=False)

        # Over HTTP/2 cleartext, a request answered before its body (415), then DATA on its stream: main at
        # f4ece67 exited 1 (Hypercorn's KeyError); the connection ends, the server goes on, over HTTP/2 too.
        port = urllib.parse.urlsplit(server.url).port
        for mode in (PRIOR_KNOWLEDGE, UPGRADE):
            assert send_then_data_after_the_answer(port, mode, "POST", "/v1/completions/render", {
                "authorization": "Bearer k", "content-type": "text/plain"}, b"0123456789") == 415
            status, _, body = h2c_request(port, mode, "POST", "/tokenize", {
                "authorization": "Bearer k", "content-type": "application/json"}, b'{"prompt": "hello"}')
            assert status == 200 and json.loads(body)["tokens"] == tokens
        assert server.process.poll() is None
    finally:
        assert server.stop() == 0, server.stderr()[-3000:]
