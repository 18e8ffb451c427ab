"""Connections and the process, on real `asyncengine serve` processes (the tiny Llama, the engine core
in its own process): `Connection: close` and HTTP/1.0 close after the response (an HTTP/1.0 stream
ends), idle keep-alive connections close after --keep-alive-timeout, a body over the limit gets its 413
while it is still being sent (and the server goes on), a body that trickles in gets a 408 after
--request-body-timeout and its connection closes (HTTP/1.1 and HTTP/2), a non-loopback bind without a
key warns, and after the engine dies the in-flight request gets its error and the server exits 1.

Server-side connections are counted from the server process's own sockets: the inodes of its file
descriptors, looked up in /proc/PID/net/tcp (state 01 is ESTABLISHED)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import h2.events
import pytest

from support.http2 import PRIOR_KNOWLEDGE, UPGRADE, open_h2c, request_headers
from support.server import ESTABLISHED, connection_states, start_server

pytestmark = pytest.mark.slow

TINY_OPTIONS = ["--skip-tokenizer-init", "--max-model-len", "512", "--kv-cache-memory-bytes", str(8 * 2**20)]
COMPLETION = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
JSON = {"Content-Type": "application/json"}
BODY_TIMEOUT = 2  # seconds (--request-body-timeout)


@pytest.fixture(scope="module")
def server(tiny_model):
    # 0.0.0.0 without a key: the warning's test; clients connect to 127.0.0.1.
    server = start_server([str(tiny_model("llama").path), *TINY_OPTIONS, "--keep-alive-timeout", "1",
                           "--request-body-timeout", str(BODY_TIMEOUT), "--host", "0.0.0.0"])
    yield server
    assert server.stop() == 0, server.stderr()[-3000:]


def port_of(server) -> int:
    return urllib.parse.urlsplit(server.url).port


def established_connections(pid: int, port: int) -> int:
    """The ESTABLISHED TCP connections on `port` that process `pid` holds open."""
    return connection_states(pid, port).count(ESTABLISHED)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def read_until_closed(sock: socket.socket, timeout: float = 60) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    sock.settimeout(timeout)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_connection_close_closes_every_connection_after_its_response(server):
    # 100 requests with `Connection: close`; the clients keep their sockets open, so only the server's
    # close can end the connections. Main at 3fd5b13: 100 still established 15 s later.
    pid, port = server.process.pid, port_of(server)
    clients = []
    for i in range(100):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        if i % 4 == 0:
            connection.request("POST", "/v1/completions", body=json.dumps(COMPLETION),
                               headers={**JSON, "Connection": "close"})
        elif i % 4 == 1:
            connection.request("POST", "/v1/completions", body=json.dumps({**COMPLETION, "stream": True}),
                               headers={**JSON, "Connection": "close"})
        else:
            connection.request("GET", "/health", headers={"Connection": "close"})
        # http.client closes its socket after a `Connection: close` response; a duplicate of it keeps the
        # client's end open.
        clients.append(connection.sock.dup())
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("Connection") == "close"
        response.read()
    try:
        wait_for(lambda: established_connections(pid, port) == 0, timeout=15,
                 what=f"the server to close its connections ({established_connections(pid, port)} established)")
        assert read_until_closed(clients[0], timeout=30) == b""
    finally:
        for sock in clients:
            sock.close()


def test_an_http_1_0_stream_ends(server):
    # HTTP/1.0 has no chunked encoding: the stream's end is the close. Main: never closed (timed out).
    body = json.dumps({**COMPLETION, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port_of(server))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        received = read_until_closed(sock)
    assert received.startswith(b"HTTP/1.1 200") and received.rstrip().endswith(b"data: [DONE]")


@pytest.mark.parametrize("head, status, code", [
    (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n", 400, "malformed_http_request"),
    (b"NOT A REQUEST LINE\r\n\r\n", 400, "malformed_http_request"),
    # h11 measures the head while it is incomplete: 20 KB of it with no end yet is over the 16 KiB limit
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000, 431,
     "request_header_fields_too_large"),
], ids=["space in a header name", "no request line", "headers over 16 KiB"])
def test_hypercorns_own_replies_carry_an_openai_error_body(server, head, status, code):
    # Hypercorn answers these before the app runs; on main its reply had `content-length: 0`.
    with socket.create_connection(("127.0.0.1", port_of(server))) as sock:
        sock.sendall(head)
        received = read_until_closed(sock)
    status_line, _, rest = received.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 %d" % status), received[:200]
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in headers.lower() and b"connection: close" in headers.lower()
    error = json.loads(body)["error"]
    assert error["code"] == code and error["message"], error


def test_hypercorn_itself_is_left_as_it_is():
    # The server builds its own subclass of Hypercorn's HTTP/1.1 protocol for its own connections
    # (server/connection.py); Hypercorn's module keeps its class, so another Hypercorn server in the
    # process (an embedder's) keeps Hypercorn's empty replies. Main at f4ece67 replaced the module's class.
    import h11
    import hypercorn.protocol
    import trio
    from hypercorn.config import Config
    from hypercorn.protocol.h11 import H11Protocol

    from asyncengine.server import run  # noqa: F401 (everything the server imports)
    from asyncengine.server.h11_errors import h11_protocol_class

    ours = h11_protocol_class()
    assert ours is not H11Protocol and issubclass(ours, H11Protocol)
    assert hypercorn.protocol.H11Protocol is H11Protocol

    class Recorder:
        def __init__(self):
            self.data = b""

        async def __call__(self, event):
            self.data += getattr(event, "data", b"")

    async def reply(protocol_class) -> bytes:
        recorder = Recorder()
        protocol = protocol_class.__new__(protocol_class)  # only what _send_error_response reads
        protocol.config, protocol.send, protocol.connection = Config(), recorder, h11.Connection(h11.SERVER)
        protocol.connection.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        protocol.connection.next_event()
        await protocol._send_error_response(400)
        return recorder.data

    theirs = trio.run(reply, hypercorn.protocol.H11Protocol)
    assert b"content-length: 0" in theirs.lower() and theirs.endswith(b"\r\n\r\n"), theirs
    mine = trio.run(reply, ours)
    assert b"application/json" in mine and mine.endswith(b"}"), mine


def test_an_idle_keep_alive_connection_is_closed_after_the_timeout(server):
    # --keep-alive-timeout 1 here. Main: still open (read timed out); 5 s would be the default.
    pid, port = server.process.pid, port_of(server)
    sockets = []
    for _ in range(3):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("POST", "/v1/completions", body=json.dumps(COMPLETION), headers=JSON)
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("Connection") is None  # kept alive
        response.read()
        sockets.append((connection.sock, time.monotonic()))
    for sock, idle_since in sockets:
        assert read_until_closed(sock, timeout=30) == b""  # closed by the server, nothing more sent
        assert time.monotonic() - idle_since >= 0.9  # not before the timeout
        sock.close()
    wait_for(lambda: established_connections(pid, port) == 0, timeout=15, what="no established connection")


def send_while_reading(server, path: str, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """A body over the limit: the server answers 413 before reading all of it and closes the connection
    (it cannot be reused), so a client that only reads once it has sent everything meets a broken pipe
    or a reset. Like a browser, this one reads the answer while it is still sending."""
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=120) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode())

        def write_body() -> None:
            try:
                sock.sendall(data)
            except OSError:  # the server has answered and closed: the rest of the body is not wanted
                pass

        writer = threading.Thread(target=write_body, daemon=True)
        writer.start()
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer) < _expected_length(answer):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        writer.join(30)
    status_line, _, rest = answer.partition(b"\r\n")
    header_block, _, raw = rest.partition(b"\r\n\r\n")
    response_headers = dict(line.decode().split(": ", 1) for line in header_block.split(b"\r\n") if line)
    return int(status_line.split()[1]), {k.lower(): v for k, v in response_headers.items()}, raw


def _expected_length(answer: bytes) -> int:
    head, _, _ = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return 1 << 62  # no length given: read until the server closes


def test_a_body_over_the_limit_is_a_413_while_it_is_sent_and_the_server_goes_on(server):
    # 3 MiB, over the default --max-request-body-bytes (2 MiB). The same case's error shape in-process:
    # tests/server/test_bad_requests.py ("oversized body").
    status, headers, raw = send_while_reading(server, "/v1/completions",
                                              json.dumps({"prompt": "a" * (3 * 2**20), "max_tokens": 2}).encode())
    assert status == 413, raw
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] is None
    assert "larger than the limit" in error["message"], error["message"]
    assert headers["content-type"] == "application/json"
    # ... and a valid request right after it is served.
    connection = http.client.HTTPConnection("127.0.0.1", port_of(server), timeout=60)
    connection.request("POST", "/v1/completions", body=json.dumps({**COMPLETION, "max_tokens": 2}), headers=JSON)
    response = connection.getresponse()
    assert response.status == 200
    assert json.loads(response.read())["usage"]["completion_tokens"] == 2
    connection.close()


def trickle_http1(port: int) -> tuple[float, bytes]:
    """A POST whose 1000-byte body comes a byte every 0.2 s: (seconds until the server closed, what it sent)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        started = time.monotonic()
        sock.settimeout(0.2)
        received = b""
        while time.monotonic() - started < 30:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                if not received:  # once the answer comes, only read
                    sock.sendall(b" ")
                continue
            except OSError:
                break
            if not chunk:
                break
            received += chunk
        return time.monotonic() - started, received


def trickle_http2(port: int, mode: str) -> tuple[float, int, bytes, bool]:
    """The same over h2c: (seconds until the answer, its status, its body, whether the connection then closed
    within 15 s while the client went on sending)."""
    sock, connection = open_h2c(port, mode)
    with sock:
        stream_id = connection.get_next_available_stream_id()
        connection.send_headers(stream_id, request_headers("POST", "/v1/completions", {
            "content-type": "application/json", "content-length": "1000"}))
        sock.sendall(connection.data_to_send())
        started = time.monotonic()
        sock.settimeout(0.2)
        status, body, ended, answered_after = 0, b"", False, 0.0
        while time.monotonic() - started < 30:
            try:
                data = sock.recv(65536)
            except socket.timeout:
                if connection.local_flow_control_window(stream_id) > 0 and not ended:
                    connection.send_data(stream_id, b" ")
                    sock.sendall(connection.data_to_send())
                continue
            if not data:
                break
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived) and event.stream_id == stream_id:
                    status = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived) and event.stream_id == stream_id:
                    body += event.data
                elif isinstance(event, h2.events.StreamEnded) and event.stream_id == stream_id:
                    ended, answered_after = True, time.monotonic() - started
            sock.sendall(connection.data_to_send())
        if not ended:
            return time.monotonic() - started, status, body, False
        # The client goes on with the body: the connection ends (the idle timer, or the protocol's fault on
        # DATA for a finished stream).
        closed, deadline = False, time.monotonic() + 15
        try:
            while not closed and time.monotonic() < deadline:
                connection.send_data(stream_id, b" ")
                sock.sendall(connection.data_to_send())
                try:
                    closed = sock.recv(65536) == b""
                except socket.timeout:
                    pass
        except OSError:  # reset by the server
            closed = True
        return answered_after, status, body, closed


def test_a_body_that_trickles_in_is_a_408_and_its_connection_closes(server):
    # --request-body-timeout 2 here. Main at f4ece67: no such limit; 40 connections sending a byte a second
    # were all still open after 60 s.
    port = port_of(server)
    with ThreadPoolExecutor(24) as pool:
        http1 = [pool.submit(trickle_http1, port) for _ in range(20)]
        http2 = [pool.submit(trickle_http2, port, mode) for mode in (PRIOR_KNOWLEDGE, UPGRADE)]
        http1_results, http2_results = [f.result() for f in http1], [f.result() for f in http2]
    for elapsed, received in http1_results:
        assert BODY_TIMEOUT <= elapsed < 30, (elapsed, received[:300])
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), received[:300]
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and "--request-body-timeout" in error["message"], error
    for elapsed, status, body, closed in http2_results:
        assert BODY_TIMEOUT <= elapsed < 30 and status == 408, (elapsed, status, body[:300])
        assert json.loads(body)["error"]["code"] == "request_timeout" and closed
    wait_for(lambda: established_connections(server.process.pid, port) == 0, timeout=15,
             what="the trickling connections to be closed")
    # ... and the server goes on
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/v1/completions", body=json.dumps(COMPLETION), headers=JSON)
    assert connection.getresponse().status == 200
    connection.close()


def test_a_non_loopback_bind_without_an_api_key_warns(server):
    assert ("asyncengine: warning: serving on 0.0.0.0 without an API key: anyone who can reach this address can "
            "use the server; set --api-key") in server.stderr()


def test_after_the_engine_dies_the_request_gets_its_error_and_the_server_exits_1(tiny_model):
    server = start_server([str(tiny_model("llama").path), *TINY_OPTIONS])
    try:
        with urllib.request.urlopen(server.base_url + "/startup") as response:
            (core_pid,) = {r["pid"] for r in json.loads(response.read()) if r["role"] == "engine core"}
        connection = http.client.HTTPConnection("127.0.0.1", port_of(server), timeout=60)
        connection.request("POST", "/v1/completions", headers=JSON, body=json.dumps(
            {"prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True, "stream": True}))
        stream = connection.getresponse()
        assert stream.status == 200
        assert stream.readline().startswith(b"data: ")  # running
        os.kill(core_pid, signal.SIGKILL)
        events = [line[6:].strip() for line in stream.read().splitlines() if line.startswith(b"data: ")]
        error = json.loads(events[-1])["error"]  # the in-flight request's error, as the stream's last event
        assert error["code"] == "engine_dead" and "SIGKILL" in error["message"]
        # Main at 3fd5b13: still running (answering 503) after 60 s.
        assert server.process.wait(60) == 1
        stderr = server.stderr()
        assert "asyncengine: the engine died (" in stderr and "exits with status 1" in stderr
        assert "Traceback" not in stderr
    finally:
        if server.process.poll() is None:
            server.stop(signal.SIGKILL)
