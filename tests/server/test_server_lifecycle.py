"""A client that drops a stream, a saturated engine, a dead engine, and graceful shutdown, on real servers."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.parse
import urllib.request

import pytest

from support.server import API_KEY, MODEL_NAME, metric, start_server

pytestmark = pytest.mark.slow

TINY_OPTIONS = ["--skip-tokenizer-init", "--max-model-len", "512", "--kv-cache-memory-bytes", str(8 * 2**20)]


def wait_for(condition, timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def open_stream(server, body: dict, headers: dict | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    url = urllib.parse.urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    connection.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                       headers={"Content-Type": "application/json", **(headers or {})})
    return connection, connection.getresponse()


def read_event(response: http.client.HTTPResponse) -> bytes:
    while True:
        line = response.readline()
        if line.startswith(b"data: "):
            return line[6:].strip()


def test_a_client_that_drops_a_stream_frees_its_request_and_kv_blocks(smol_server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    connection, response = open_stream(smol_server, {"model": MODEL_NAME, "prompt": "Tell me a long story.",
                                                     "max_tokens": 400, "ignore_eos": True}, auth)
    assert response.status == 200
    for _ in range(3):
        json.loads(read_event(response))
    assert metric(smol_server, "num_requests_running") == 1
    assert metric(smol_server, "kv_cache_usage_perc") > 0
    connection.sock.close()  # the client goes away mid-stream
    connection.close()
    wait_for(lambda: metric(smol_server, "num_requests_running") == 0, what="the request to be aborted")
    wait_for(lambda: metric(smol_server, "kv_cache_usage_perc") == 0, what="its KV blocks to be freed")
    with urllib.request.urlopen(smol_server.url + "/health") as health:
        assert health.status == 200  # and the server goes on serving


@pytest.fixture
def tiny_server(tiny_model):
    servers = []

    def start(*extra: str):
        server = start_server([str(tiny_model("llama").path), *TINY_OPTIONS, *extra])
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(signal.SIGKILL)


def test_a_saturated_engine_answers_503_with_retry_after(tiny_server):
    server = tiny_server("--max-num-seqs", "1", "--max-waiting-requests", "1")
    long = {"prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True}
    first_connection, first = open_stream(server, long)
    read_event(first)  # running
    second_status: list[int] = []
    second = threading.Thread(target=lambda: second_status.append(open_stream(server, long)[1].status))
    second.start()
    wait_for(lambda: metric(server, "num_requests_waiting") == 1, what="the second request to wait")
    connection, third = open_stream(server, long)
    body = json.loads(third.read())
    assert third.status == 503 and third.getheader("Retry-After") == "1"
    assert body["error"]["code"] == "engine_overloaded" and "max_waiting_requests" in body["error"]["message"]
    first_connection.close()
    second.join(60)
    assert second_status == [200]


def test_a_dead_engine_makes_health_fail_and_requests_503(tiny_server):
    # Without the flag the server exits 1 after the engine's death (tests/server/test_http_hardening.py).
    server = tiny_server("--keep-serving-after-engine-death")
    with urllib.request.urlopen(server.base_url + "/startup") as response:
        (core_pid,) = {r["pid"] for r in json.loads(response.read()) if r["role"] == "engine core"}
    os.kill(core_pid, signal.SIGKILL)

    def health_status() -> int:
        try:
            with urllib.request.urlopen(server.url + "/health") as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code

    wait_for(lambda: health_status() == 503, timeout=10, what="/health to fail")
    connection, response = open_stream(server, {"prompt": [5, 6], "max_tokens": 2})
    body = json.loads(response.read())
    assert response.status == 503 and body["error"]["code"] == "engine_dead"
    assert f"pid {core_pid}" in body["error"]["message"] and "SIGKILL" in body["error"]["message"]
    assert server.stop() == 0


def test_sigterm_lets_a_running_stream_finish_then_exits_0(tiny_server):
    server = tiny_server()
    connection, response = open_stream(server, {"prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True})
    read_event(response)
    server.process.send_signal(signal.SIGTERM)
    events = []
    while (event := read_event(response)) != b"[DONE]":
        events.append(json.loads(event))
    assert events[-1]["choices"][0]["finish_reason"] == "length"  # the stream ran to its end
    assert server.process.wait(60) == 0
    assert "SIGTERM received" in server.stderr()


def test_an_idle_keep_alive_connection_does_not_hold_the_exit(tiny_server):
    # An OpenAI client's pool keeps its connection open after a request; Hypercorn alone would wait its
    # whole graceful timeout (31 s) for it. The server stops once the engine's shutdown is over.
    server = tiny_server()
    connection, response = open_stream(server, {"prompt": [5, 6, 7], "max_tokens": 3})
    while read_event(response) != b"[DONE]":
        pass
    assert connection.sock is not None  # still open, idle
    assert server.stop(signal.SIGTERM, timeout=10) == 0
    assert "Traceback" not in server.stderr()
    connection.close()
