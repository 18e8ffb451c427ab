"""Endpoint plugins written as vLLM's are (tests/plugins/vllm-shaped-endpoint: `attach_router` on a FastAPI
app, `init_state(engine_client, state, args)`, `required_tasks`), ported by `asyncengine plugins port` alone
and served, with fastapi installed into a target of its own (never into .venv):
- the plugin's FastAPI routes answer through our server: path and query parameters and a JSON body parsed
  by FastAPI, a streamed body, `raw_request.app.state` filled by init_state with our engine client (whose
  model_config and collective_rpc the routes call) and the options;
- they are behind what built-in routes are behind: the API key, the request id, the OpenAPI listing; a
  route that raises is a 500 and the server goes on;
- a plugin whose required_tasks this server does not serve fails start-up naming it (vLLM leaves it out
  silently), and without fastapi a FastAPI-form plugin fails start-up naming the package (in
  tests/plugin_runtime/test_vllm_shaped_contracts.py, whose processes have no fastapi);
- vLLM's dummy plugin contract (required_tasks None): on the render server (no engine) init_state gets
  None and its route answers 503; on the full server it gets the engine and the route answers from
  collective_rpc; a plugin requiring "generate" fails the render server's start-up, naming it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.vllm_shaped import environment, port_and_install

# fastapi's own dependencies (pydantic, anyio, typing-extensions ...) are in .venv already.
FASTAPI = ["fastapi==0.142.2", "starlette==1.7.0", "opentelemetry-api==1.45.0"]

SCRIPT = r"""
import json, sys
import trio
from asyncengine import AsyncEngine
from asyncengine.server.app import create_app
from asyncengine.server.config import ServerConfig

KEY = {"Authorization": "Bearer sesame"}


async def main(model):
    async with AsyncEngine.start(model=model, skip_tokenizer_init=True, max_model_len=256,
                                 kv_cache_memory_bytes=4 * 2**20) as engine:
        app = create_app(engine, ServerConfig(api_key="sesame"))
        async with app.test_app() as running:
            client = running.test_client()
            seen = {}

            async def call(name, path, **options):
                response = await client.open(path, **options)
                seen[name] = [response.status_code, (await response.get_data()).decode(),
                              response.headers.get("X-Request-Id")]

            await call("model", "/v1/admin/model", headers={**KEY, "X-Request-Id": "admin-1"})
            await call("no_key", "/v1/admin/model")
            await call("workers", "/v1/admin/workers", headers=KEY)
            await call("echo", "/v1/admin/echo/hi?times=2", method="POST", json={"a": 1}, headers=KEY)
            await call("count", "/v1/admin/count?n=4", headers=KEY)
            await call("fail", "/v1/admin/fail", headers=KEY)
            await call("after_fail", "/v1/admin/count?n=1", headers=KEY)
            await call("openapi", "/openapi.json", headers=KEY)
    # A plugin requiring a task this server does not serve: refused with the other contracts (the runner
    # given; once "auto" resolves, the server refuses it: tests/server/test_endpoint_required_tasks.py).
    for runner in ("generate",):
        try:
            async with AsyncEngine.start(model=model, skip_tokenizer_init=True, max_model_len=256,
                                         kv_cache_memory_bytes=4 * 2**20, runner=runner,
                                         plugins="vllm_shaped_embed_only") as engine:
                create_app(engine, ServerConfig())
            seen["refused_" + runner] = None
        except Exception as exc:
            seen["refused_" + runner] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(seen))


trio.run(main, sys.argv[1])
"""


RENDER_SCRIPT = r"""
import json, sys
import trio
from asyncengine import AsyncEngine
from asyncengine.server.app import create_app
from asyncengine.server.config import ServerConfig
from asyncengine.server.render_server import RenderClient

OPTIONS = dict(skip_tokenizer_init=True, max_model_len=256)


async def get(client, name, seen):
    app = create_app(client, ServerConfig())
    async with app.test_app() as running:
        response = await running.test_client().get("/v1/admin/scheduler_config")
        seen[name] = [response.status_code, (await response.get_data()).decode()]


async def main(model):
    seen = {}
    async with RenderClient.start(model=model, **OPTIONS) as client:
        await get(client, "render", seen)
    async with AsyncEngine.start(model=model, kv_cache_memory_bytes=4 * 2**20, **OPTIONS) as engine:
        await get(engine, "full", seen)
    try:
        async with RenderClient.start(model=model, plugins="vllm_shaped_admin", **OPTIONS) as client:
            create_app(client, ServerConfig())
        seen["refused"] = None
    except Exception as exc:
        seen["refused"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(seen))


trio.run(main, sys.argv[1])
"""


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-endpoint")
    plugin, report = port_and_install("vllm-shaped-endpoint", root)
    fastapi = root / "fastapi"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                                str(fastapi), *FASTAPI], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return plugin, fastapi, report


def test_the_port_tool_maps_every_use(targets):
    _, _, report = targets
    assert "setup.cfg:12: rewrite: vllm.endpoint_plugins =  ->  asyncengine.endpoint_plugins =" in report
    assert '"VLLM_PLUGINS"  ->  "ASYNCENGINE_PLUGINS"' in report
    assert "0 use(s) cannot be mapped" in report


@pytest.mark.extension_point("E5")
def test_the_ported_fastapi_plugin_is_served(targets, tiny_model, tmp_path):
    plugin, fastapi, _ = targets
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    model = str(tiny_model("llama").path)
    result = subprocess.run([sys.executable, str(script), model], capture_output=True, text=True, timeout=300,
                            env=environment(plugin, fastapi, ASYNCENGINE_PLUGINS="vllm_shaped_admin"))
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])

    status, body, request_id = seen["model"]
    assert status == 200, body
    assert json.loads(body) == {"max_model_len": 256, "model": model, "allowed": "vllm_shaped_admin"}
    assert request_id == "admin-1"
    assert seen["no_key"][0] == 401  # --api-key covers a plugin's routes too
    assert seen["workers"][:2] == [200, '{"ranks":1}']  # collective_rpc reached the worker
    assert seen["echo"][0] == 200 and json.loads(seen["echo"][1]) == {"words": ["hi", "hi"], "body": {"a": 1}}
    assert seen["count"][:2] == [200, "0\n1\n2\n3\n"]
    assert seen["fail"][0] == 500
    assert "the admin route failed" in result.stderr  # logged, with the plugin named
    assert "endpoint plugin 'vllm_shaped_admin'" in result.stderr
    assert seen["after_fail"][:2] == [200, "0\n"]
    for runner in ("generate",):
        assert ("endpoint plugin 'vllm_shaped_embed_only' (vllm_shaped_endpoint:EmbedOnlyEndpoint") in \
            (seen["refused_" + runner] or ""), seen
        assert ("requires one of the tasks embed, and this server serves generate: leave the plugin out of the "
                "allow-list (--plugins)") in seen["refused_" + runner]
    paths = json.loads(seen["openapi"][1])["paths"]
    assert {"/v1/admin/model", "/v1/admin/count"} <= set(paths)
    assert any(path.startswith("/v1/admin/echo/") for path in paths), sorted(paths)


def test_the_render_server_gives_the_dummy_plugin_no_engine_client(targets, tiny_model, tmp_path):
    """vLLM's test_render_server_attaches_endpoint_plugins_with_no_engine_client, on our render server."""
    plugin, fastapi, _ = targets
    script = tmp_path / "render.py"
    script.write_text(RENDER_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tiny_model("llama").path)], capture_output=True,
                            text=True, timeout=300,
                            env=environment(plugin, fastapi, ASYNCENGINE_PLUGINS="vllm_shaped_dummy_admin"))
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    status, body = seen["render"]
    assert status == 503, body  # init_state(None, ...): the plugin's own answer without a client
    assert json.loads(body) == {"detail": "scheduler_config requires an engine, which this server does not have"}
    status, body = seen["full"]
    assert status == 200, body
    assert len(json.loads(body)["scheduler_config"]) == 1  # collective_rpc reached the one worker
    assert "endpoint plugin 'vllm_shaped_admin' (vllm_shaped_endpoint:AdminEndpoint" in (seen["refused"] or ""), seen
    assert "requires one of the tasks generate, and this server serves render" in seen["refused"]
