"""An endpoint plugin in vLLM's FastAPI form gets its app's lifespan run with the server's
(asyncengine/server/fastapi_endpoints.py): `@app.on_event("startup"/"shutdown")` handlers, or a lifespan
context the plugin sets on `app.router.lifespan_context` (one that opens a task group around its
`yield` included: entered and left in the same task), after `init_state` and before the first request,
and its shutdown when the server stops; the mapping a lifespan yields is each request's
`request.state`. Run on our server's app class with the plugins mounted as create_app mounts them, in
a process with fastapi (installed into a target of its own, never into .venv); no engine is needed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.vllm_shaped import environment

FASTAPI = ["fastapi==0.142.2", "starlette==1.7.0", "opentelemetry-api==1.45.0"]  # as test_vllm_shaped_endpoint

SCRIPT = r"""
import argparse, contextlib, json, warnings
import anyio, trio
from fastapi import FastAPI, Request
from asyncengine.server.app import ApiApp
from asyncengine.server.fastapi_endpoints import RouterEndpoint
from asyncengine.server.transport import ResponseCounter

events = []


class EventsPlugin:  # vLLM's form, with FastAPI's startup and shutdown events
    name = "events_plugin"
    required_tasks = None

    def attach_router(self, app):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # FastAPI prefers lifespan; plugins use both

            @app.on_event("startup")
            async def started():
                await anyio.sleep(0)
                events.append("events: startup")

            @app.on_event("shutdown")
            async def stopped():
                await anyio.sleep(0.01)
                events.append("events: shutdown")

        @app.get("/v1/events")
        async def route():
            events.append("events: request")
            return {"ok": True}

    def init_state(self, engine_client, state, args):
        events.append("events: init_state")


class LifespanPlugin:  # a lifespan context with state, and a task group around its yield
    name = "lifespan_plugin"
    required_tasks = None

    def attach_router(self, app):
        @contextlib.asynccontextmanager
        async def lifespan(app):
            async with anyio.create_task_group() as tg:
                events.append("lifespan: enter")
                tg.start_soon(anyio.sleep_forever)
                yield {"greeting": "hi"}
                tg.cancel_scope.cancel()
            events.append("lifespan: exit")

        app.router.lifespan_context = lifespan

        @app.get("/v1/greeting")
        async def route(request: Request):
            events.append("lifespan: request")
            return {"greeting": request.state.greeting}

    async def init_state(self, engine_client, state, args):
        events.append("lifespan: init_state")


async def main():
    app = ApiApp("lifespan-test")
    app.http_middlewares, app.responses = [], ResponseCounter()
    app.config.update(BACKGROUND_TASK_SHUTDOWN_TIMEOUT=30.0, RESPONSE_TIMEOUT=None)
    plugins = [RouterEndpoint(plugin, argparse.Namespace(model="m")) for plugin in (EventsPlugin(), LifespanPlugin())]
    for plugin in plugins:
        plugin.attach(app)

    @app.before_serving
    async def start():  # as create_app starts them
        for plugin in plugins:
            await app.nursery.start(plugin.serve, None)

    answers = {}
    async with app.test_app() as running:
        client = running.test_client()
        events.append("server: serving")
        for path in ("/v1/events", "/v1/greeting"):
            response = await client.get(path)
            answers[path] = [response.status_code, await response.get_json()]
    events.append("server: stopped")
    print(json.dumps({"events": events, "answers": answers}))


trio.run(main)
"""


@pytest.fixture(scope="module")
def fastapi_target(tmp_path_factory):
    target = tmp_path_factory.mktemp("fastapi")
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                                str(target), *FASTAPI], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return target


@pytest.mark.extension_point("E5")
def test_the_plugin_apps_lifespan_runs_with_the_servers(fastapi_target, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env=environment(fastapi_target))
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["answers"] == {"/v1/events": [200, {"ok": True}], "/v1/greeting": [200, {"greeting": "hi"}]}
    events = seen["events"]
    for plugin in ("events", "lifespan"):
        mine = [event.partition(": ")[2] for event in events if event.startswith(plugin + ":")]
        first, last = ("startup", "shutdown") if plugin == "events" else ("enter", "exit")
        assert mine == ["init_state", first, "request", last], events
    serving, stopped = events.index("server: serving"), events.index("server: stopped")
    assert events.index("events: startup") < serving and events.index("lifespan: enter") < serving
    assert serving < events.index("events: shutdown") < stopped  # the server waited for the shutdown
    assert serving < events.index("lifespan: exit") < stopped
