"""StatsEndpoint: its route on a QuartTrio app, and its background task against a fake engine client."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import trio
from quart_trio import QuartTrio

import ae_endpoint_example
from ae_endpoint_example import ROUTE, StatsEndpoint, make_endpoint
from asyncengine.plugins_api import EndpointPlugin


def stats(running, waiting=0):
    return SimpleNamespace(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=0.25)


class FakeEngineClient:
    """Answers get_scheduler_stats from a script of stats (or exceptions), then idles."""

    def __init__(self, script):
        self.script = list(script)
        self.calls = 0

    async def get_scheduler_stats(self):
        self.calls += 1
        answer = self.script.pop(0) if self.script else stats(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.fixture(autouse=True)
def a_process_role(monkeypatch):
    monkeypatch.setattr(ae_endpoint_example, "current_process_role", lambda: "frontend")
    monkeypatch.setattr(ae_endpoint_example, "_recorded", set())
    monkeypatch.delenv("AE_PLUGIN_RECORD", raising=False)


def test_the_factory_makes_an_endpoint_plugin():
    plugin = make_endpoint()
    assert isinstance(plugin, EndpointPlugin) and plugin.name == "example-stats" and not plugin.override
    assert make_endpoint() is not plugin  # one instance per server


def run_serve(plugin, client, until):
    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(plugin.serve, client)
            with trio.fail_after(10):
                while not until():
                    await trio.sleep(0.005)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_background_task_keeps_the_most_requests_seen_and_survives_errors():
    plugin = StatsEndpoint()
    plugin.poll_interval = 0.001
    client = FakeEngineClient([stats(0), stats(3, 2), RuntimeError("engine stopping"), stats(1)])
    run_serve(plugin, client, until=lambda: client.calls >= 6)
    watch = plugin.watch.as_dict()
    assert watch["polling"] and watch["polls"] == client.calls - 1  # one call raised
    assert watch["max_running"] == 3 and watch["max_waiting"] == 2 and watch["busy_polls"] == 2
    assert watch["running"] == 0 and watch["kv_cache_usage"] == 0.25
    assert watch["errors"] == 1 and watch["last_error"] == "RuntimeError: engine stopping"


def test_the_route_answers_with_what_the_task_saw(tmp_path, monkeypatch):
    records = tmp_path / "records.jsonl"
    monkeypatch.setenv("AE_PLUGIN_RECORD", str(records))
    app = QuartTrio(__name__)
    plugin = make_endpoint()
    plugin.attach(app)
    plugin.poll_interval = 0.001
    client = FakeEngineClient([stats(2)])
    run_serve(plugin, client, until=lambda: client.calls >= 2)

    async def get():
        response = await app.test_client().get(ROUTE)
        return response.status_code, await response.get_json()

    status, body = trio.run(get)
    assert status == 200
    assert body["max_running"] == 2 and body["polls"] >= 2 and body["polling"] and body["errors"] == 0
    trio.run(get)
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert [(line["what"], line["role"]) for line in lines] == [
        ("endpoint attach", "frontend"), ("endpoint background task", "frontend"), ("endpoint route", "frontend")]


def test_before_the_task_starts_the_route_says_so():
    app = QuartTrio(__name__)
    make_endpoint().attach(app)

    async def get():
        return await (await app.test_client().get(ROUTE)).get_json()

    body = trio.run(get)
    assert body["polling"] is False and body["polls"] == 0


def test_the_middleware_tags_the_response_with_the_server_pid():
    import os
    from types import SimpleNamespace

    import anyio

    from ae_endpoint_example.middleware import HEADER, served_by

    response = SimpleNamespace(headers={})

    async def call_next(request):
        return response

    async def main():
        return await served_by(SimpleNamespace(path="/v1/models"), call_next)

    assert anyio.run(main, backend="trio") is response
    assert response.headers[HEADER] == f"asyncengine pid {os.getpid()}"
