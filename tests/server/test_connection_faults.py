"""No connection can take the server down (issue 30, item 1 and acceptance 1), on the shared real server
(tests/server/conftest.py: the default model, its engine core in its own process, an API key).

- Over HTTP/2 cleartext, by prior knowledge and by h2c upgrade: a request the server answers before
  reading its body (text/plain to /v1/completions: 415; a 60 KB keyless POST: 401; a POST to /health:
  405; a body declared over the limit: 413), then a DATA frame on its stream. Hypercorn 0.18's HTTP/2
  protocol raises KeyError there, which used to end the server and its engine (exit 1); now the
  connection ends and the server answers the next request, over HTTP/2 and HTTP/1.1.
- An HTTP/2 frame fuzz of 500 connections (seeded): random frame orders, RST_STREAM, WINDOW_UPDATE
  (0, huge, on stream 0), PRIORITY (on itself, before HEADERS), SETTINGS (invalid values, ACK with a
  payload), GOAWAY, PING, PUSH_PROMISE from the client, CONTINUATION without HEADERS, HEADERS without
  END_HEADERS, bad lengths and padding, DATA after END_STREAM, unknown frame types, garbage, pauses
  that let answers go out before more frames arrive; over prior knowledge and h2c upgrade (some with a
  malformed HTTP2-Settings). In batches of 100 connections in parallel, each batch followed by a
  normal request over HTTP/2 and over HTTP/1.1, the server process still alive.
- The same for HTTP/1.1 with malformed framing (500 connections): bad chunked encoding, Content-Length
  mismatches and duplicates, Content-Length with Transfer-Encoding, pipelined garbage, oversized
  heads, bad request lines, odd upgrades, bytes split at random with pauses.

After each fuzz no request is left running (asyncengine:num_requests_running is 0) and the server holds
no connection of it (its sockets on the port: main's Hypercorn worker kept an HTTP/2 connection whose
client had gone, with a response in its last send, open for good).
"""

from __future__ import annotations

import json
import random
import socket
import struct
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import hpack
import pytest

from support.http2 import (
    PRIOR_KNOWLEDGE,
    UPGRADE,
    client_connection,
    h2c_request,
    read_http1_head,
    send_then_data_after_the_answer,
    upgrade_head,
)
from support.server import API_KEY, LISTEN, MODEL_NAME, connection_states, metric

pytestmark = pytest.mark.slow

AUTH = {"authorization": f"Bearer {API_KEY}"}
NORMAL = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1}
BATCH, PARALLEL = 100, 16
CONNECTIONS = 500


def port_of(server) -> int:
    return urllib.parse.urlsplit(server.url).port


def assert_serving(server, mode: str = PRIOR_KNOWLEDGE) -> None:
    """The server is alive and answers a normal completion over HTTP/2 (`mode`) and over HTTP/1.1."""
    assert server.process.poll() is None, f"the server exited ({server.process.returncode}):\n{server.stderr()[-3000:]}"
    status, _, body = h2c_request(port_of(server), mode, "POST", "/v1/completions",
                                  {**AUTH, "content-type": "application/json"}, json.dumps(NORMAL).encode())
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 1, (status, body[:300])
    request = urllib.request.Request(server.base_url + "/completions", data=json.dumps(NORMAL).encode(),
                                     headers={**AUTH, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == 1


# -- the sequence of issue 30 -----------------------------------------------------------------------------

ANSWERED_BEFORE_THE_BODY = [
    ("POST", "/v1/completions", {**AUTH, "content-type": "text/plain"}, b"0123456789", 415),
    ("POST", "/v1/completions", {"content-type": "application/json", "content-length": "61440"}, b"x" * 61440, 401),
    ("POST", "/health", {"content-type": "application/json"}, b"0123456789", 405),
    ("POST", "/v1/completions", {**AUTH, "content-type": "application/json", "content-length": str(3 * 2**20)},
     b"0123456789", 413),
]


@pytest.mark.parametrize("mode", [PRIOR_KNOWLEDGE, UPGRADE])
def test_data_after_an_early_answer_over_h2c_ends_only_its_connection(smol_server, mode):
    # main at f4ece67: the first of these made Hypercorn raise KeyError, and the server exited 1.
    for method, path, headers, data, status in ANSWERED_BEFORE_THE_BODY:
        assert send_then_data_after_the_answer(port_of(smol_server), mode, method, path, headers, data) == status
        assert smol_server.process.poll() is None, smol_server.stderr()[-3000:]
    assert_serving(smol_server, mode)


# Three more requests, one each, that ended the server under Hypercorn's worker (main at f4ece67 exited 1).
ONE_REQUEST_KILLS = {
    # h11.LocalProtocolError, over HTTP/1.1: the WebSocket stream's 400, then the app's rejection
    "bytes after a WebSocket upgrade to a route without one": (
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\nxxxxxxx"),
    "an h2c upgrade whose HTTP2-Settings is not base64": upgrade_head(b"AAAAAAA"),  # binascii.Error
    "an h2c upgrade whose HTTP2-Settings is no SETTINGS payload": upgrade_head(b"AAAA"),  # InvalidFrameError
}


def test_other_requests_that_ended_the_server_end_only_their_connection(smol_server):
    for what, request in ONE_REQUEST_KILLS.items():
        with socket.create_connection(("127.0.0.1", port_of(smol_server)), timeout=30) as sock:
            sock.sendall(request)
            try:
                while sock.recv(65536):  # until the server closes it
                    pass
            except OSError:
                pass
        assert smol_server.process.poll() is None, f"{what}: the server exited\n{smol_server.stderr()[-3000:]}"
    assert_serving(smol_server, UPGRADE)


# -- HTTP/2 frame fuzz ---------------------------------------------------------------------------------

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, END_HEADERS, PADDED, PRIORITY_FLAG, ACK = 0x1, 0x4, 0x8, 0x20, 0x1
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"", length: int | None = None) -> bytes:
    """One HTTP/2 frame; `length` other than the payload's makes a frame with a bad length."""
    declared = len(payload) if length is None else length
    return struct.pack(">I", declared)[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id & 0x7FFFFFFF) + payload


def settings_payload(rng: random.Random) -> bytes:
    values = [(1, rng.choice([0, 4096, 2**32 - 1])), (2, rng.choice([0, 1, 2])), (3, rng.choice([0, 1, 100])),
              (4, rng.choice([0, 65535, 2**31 - 1, 2**31])), (5, rng.choice([16384, 100, 2**24])),
              (6, rng.choice([0, 100, 2**32 - 1])), (8, rng.choice([0, 1, 7])), (rng.randrange(9, 2**16), 1)]
    return b"".join(struct.pack(">HI", key, value) for key, value in rng.sample(values, rng.randint(0, 4)))


def header_block(rng: random.Random, encoder: hpack.Encoder) -> bytes:
    method, path = rng.choice([("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/health"),
                               ("GET", "/health"), ("GET", "/v1/models"), ("POST", "/tokenize"), ("GET", "/nope"),
                               ("CONNECT", "/v1/models"), ("PUT", "/v1/completions"), ("POST", "")])
    headers = [(":method", method), (":path", path), (":scheme", "http"), (":authority", "127.0.0.1")]
    if method == "CONNECT" and rng.random() < 0.7:
        headers.append((":protocol", "websocket"))
    if rng.random() < 0.8:
        headers += list(AUTH.items())
    headers.append(("content-type", rng.choice(["application/json", "application/json", "text/plain", ""])))
    if rng.random() < 0.3:
        headers.append(("content-length", str(rng.choice([0, 5, 10, 2**20, 10**20]))))
    if rng.random() < 0.1:  # what HTTP/2 forbids: a connection header, an upper-case name, a late pseudo-header
        headers.append(rng.choice([("connection", "keep-alive"), ("X-Upper", "1"), (":path", "/again"), ("te", "gzip")]))
    if rng.random() < 0.1:
        rng.shuffle(headers)
    return encoder.encode(headers)


def request_body(rng: random.Random) -> bytes:
    if rng.random() < 0.05:  # valid: reaches the engine, then is reset, cut or left
        return json.dumps({**NORMAL, "stream": rng.random() < 0.5, "max_tokens": rng.choice([1, 2])}).encode()
    return rng.randbytes(rng.choice([0, 1, 10, 1000, 20000]))


def h2_action(rng: random.Random, encoder: hpack.Encoder, streams: list[int]) -> bytes | float:
    """One thing to send (bytes) or a pause (seconds)."""
    stream = rng.choice(streams)
    kind = rng.random()
    if kind < 0.22:
        block = header_block(rng, encoder)
        flags = (END_HEADERS if rng.random() < 0.85 else 0) | (END_STREAM if rng.random() < 0.4 else 0)
        if rng.random() < 0.1:
            flags |= PRIORITY_FLAG
            block = struct.pack(">IB", rng.choice([0, stream, 3]), rng.randrange(256)) + block
        if rng.random() < 0.05:
            flags |= PADDED
            block = bytes([rng.choice([0, 3, 255])]) + block + b"\0" * rng.choice([0, 3])
        return frame(HEADERS, flags, stream, block)
    if kind < 0.42:
        payload = request_body(rng)
        return frame(DATA, END_STREAM if rng.random() < 0.5 else 0, stream, payload)
    if kind < 0.50:
        return frame(RST_STREAM, 0, stream, struct.pack(">I", rng.choice([0, 1, 2, 8, 2**32 - 1])),
                     length=rng.choice([None, None, 3, 5]))
    if kind < 0.58:
        return frame(WINDOW_UPDATE, 0, rng.choice([0, stream]), struct.pack(">I", rng.choice([0, 1, 65535, 2**31 - 1])),
                     length=rng.choice([None, None, 3]))
    if kind < 0.64:
        return frame(PRIORITY, 0, stream, struct.pack(">IB", rng.choice([0, stream, 1, 2**31 | 3]), rng.randrange(256)),
                     length=rng.choice([None, None, 4]))
    if kind < 0.70:
        ack = rng.random() < 0.2
        return frame(SETTINGS, ACK if ack else 0, rng.choice([0, 0, 0, stream]), settings_payload(rng))
    if kind < 0.73:
        return frame(GOAWAY, 0, rng.choice([0, stream]), struct.pack(">II", rng.choice([0, stream, 2**31 - 1]), 0))
    if kind < 0.76:
        return frame(PING, rng.choice([0, ACK]), rng.choice([0, stream]), b"\0" * rng.choice([8, 8, 7]))
    if kind < 0.79:
        return frame(CONTINUATION, rng.choice([0, END_HEADERS]), stream, header_block(rng, encoder))
    if kind < 0.81:
        return frame(PUSH_PROMISE, END_HEADERS, stream, struct.pack(">I", 2) + header_block(rng, encoder))
    if kind < 0.84:  # a frame whose declared length is not its payload's, or over the maximum frame size
        return frame(rng.choice([DATA, HEADERS, SETTINGS]), 0, stream, rng.randbytes(rng.randrange(20)),
                     length=rng.choice([0, 1, 2**14 + 1, 2**24 - 1]))
    if kind < 0.86:
        return frame(rng.randrange(10, 256), rng.randrange(256), stream, rng.randbytes(rng.randrange(20)))
    if kind < 0.88:
        return rng.randbytes(rng.randrange(1, 40))
    return rng.choice([0.0, 0.01, 0.05, 0.1])  # lets the server answer before the next frames arrive


def h2_connection_script(rng: random.Random) -> tuple[str, bytes, list[bytes | float]]:
    """(mode, what opens the connection, then the actions) for one fuzzed connection."""
    encoder = hpack.Encoder()
    streams = [1, 1, 3, 3, 5, 7, 0, 2, 2**31 - 1, rng.randrange(9, 1000, 2)]
    actions = [h2_action(rng, encoder, streams) for _ in range(rng.randint(1, 12))]
    if rng.random() < 0.25:
        settings = client_connection().initiate_upgrade_connection()
        if rng.random() < 0.2:
            settings = rng.choice([b"!!", b"AAAA", b"A" * 7, b""])
        return UPGRADE, upgrade_head(settings, rng.choice(["/health", "/v1/models", "/nope"])), actions
    opening = PREFACE + (frame(SETTINGS, 0, 0, settings_payload(rng)) if rng.random() < 0.9 else b"")
    return PRIOR_KNOWLEDGE, opening, actions


def run_connection(port: int, opening: bytes, actions: list[bytes | float], *, expect_upgrade: bool) -> None:
    """Send it all (stopping if the server closes), then read until the server closes (or 10 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(opening)
            if expect_upgrade:
                head, _ = read_http1_head(sock)  # a 101, or a 400 for bad settings
                if head.startswith(b"HTTP/1.1 101"):
                    sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
            for action in actions:
                if isinstance(action, float):
                    time.sleep(action)
                else:
                    sock.sendall(action)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
        except (OSError, AssertionError):  # reset, closed early, timed out: all the server's right
            pass


def held_connections(server) -> int:
    """The server's sockets on its port that are not listening: connections it still holds."""
    return sum(state != LISTEN for state in connection_states(server.process.pid, port_of(server)))


def fuzz_in_batches(server, scripts, run) -> None:
    """`run(port, script)` for each script, BATCH at a time, PARALLEL at once, each batch followed by a
    normal request; then no request is left running, and the server holds no connection of the fuzz."""
    port, held_before = port_of(server), held_connections(server)
    for start in range(0, len(scripts), BATCH):
        with ThreadPoolExecutor(PARALLEL) as pool:
            list(pool.map(lambda script: run(port, script), scripts[start:start + BATCH]))
        assert_serving(server, PRIOR_KNOWLEDGE if start % (2 * BATCH) else UPGRADE)
    deadline = time.monotonic() + 30
    while metric(server, "num_requests_running") != 0 or held_connections(server) > held_before:
        assert time.monotonic() < deadline, (
            f"30 s after the fuzz, {metric(server, 'num_requests_running')} requests still run and the server holds "
            f"{held_connections(server)} connections ({held_before} before it; TCP states of its sockets: "
            f"{connection_states(server.process.pid, port)})")
        time.sleep(0.2)


def test_an_h2_frame_fuzz_leaves_the_server_serving(smol_server):
    rng = random.Random(30)
    scripts = [h2_connection_script(rng) for _ in range(CONNECTIONS)]
    fuzz_in_batches(smol_server, scripts, lambda port, script: run_connection(
        port, script[1], script[2], expect_upgrade=script[0] == UPGRADE))


# -- HTTP/1.1 malformed framing -------------------------------------------------------------------------


def http1_head(rng: random.Random, extra: str = "", method: str = "POST", path: str = "/v1/completions") -> bytes:
    auth = f"Authorization: Bearer {API_KEY}\r\n" if rng.random() < 0.8 else ""
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n{extra}".encode()


def http1_fragment(rng: random.Random) -> bytes:
    body = request_body(rng)
    choice = rng.randrange(14)
    if choice == 0:  # bad chunked encoding
        chunk = rng.choice([b"zz\r\n", b"-1\r\n", b"f" * 40 + b"\r\n", b"5\r\nab\r\n", b"5;x=\0\r\nhello\r\n",
                            b"3\r\nabcdef\r\n", b"0\r\nBad Trailer\r\n\r\n", b"5\nhello\n0\n\n", b"\r\n\r\n"])
        return http1_head(rng, "Transfer-Encoding: chunked\r\n\r\n") + chunk
    if choice == 1:  # valid chunks, then cut or not ended
        return (http1_head(rng, "Transfer-Encoding: chunked\r\n\r\n")
                + b"%x\r\n" % len(body) + body + rng.choice([b"\r\n0\r\n\r\n", b"\r\n", b""]))
    if choice == 2:  # Content-Length larger or smaller than the body
        return http1_head(rng, f"Content-Length: {len(body) + rng.choice([-3, 1, 1000])}\r\n\r\n") + body
    if choice == 3:  # conflicting or malformed lengths
        value = rng.choice(["5, 6", "-1", "1e3", "0x10", " 10", "10" * 20, "99999999999999999999"])
        twice = f"Content-Length: {len(body)}\r\n" if rng.random() < 0.5 else ""
        return http1_head(rng, f"Content-Length: {value}\r\n{twice}\r\n") + body
    if choice == 4:  # both framings, or an unknown coding
        coding = rng.choice(["chunked", "gzip, chunked", "chunked, gzip", "identity", "Chunked "])
        return http1_head(rng, f"Content-Length: {len(body)}\r\nTransfer-Encoding: {coding}\r\n\r\n") + body
    if choice == 5:  # pipelining: valid requests, then garbage
        valid = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * rng.randint(1, 20)
        return valid + rng.choice([rng.randbytes(50), b"GET / HTTP/1.1\r\n", b"\r\n\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\n"])
    if choice == 6:  # oversized heads
        return rng.choice([http1_head(rng, "X-Big: " + "a" * 20000 + "\r\n\r\n"),
                           http1_head(rng, "".join(f"X-{i}: {i}\r\n" for i in range(2000)) + "\r\n"),
                           b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"])
    if choice == 7:  # bad request lines and header lines
        return rng.choice([b"GET  /  HTTP/1.1\r\nHost: x\r\n\r\n", b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
                           b"GET / HTTP/1.1\nHost: x\n\n", b"\0\1\2\3\r\n\r\n", b"GET / HTTP/1.1\r\n folded: x\r\n\r\n",
                           b"GET / HTTP/1.1\r\nNoColon\r\n\r\n", b"G\xffT / HTTP/1.1\r\nHost: x\r\n\r\n",
                           b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", b" / HTTP/1.1\r\n\r\n"])
    if choice == 8:  # upgrades: h2c with a body, with bad settings; websocket without a route
        return rng.choice([
            http1_head(rng, f"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
                            f"Content-Length: {len(body)}\r\n\r\n") + body,
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
            b"HTTP2-Settings: !!notbase64\r\n\r\n" + rng.randbytes(30),
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n" + rng.randbytes(30),
        ])
    if choice == 9:  # Expect: 100-continue, then not the body promised
        return http1_head(rng, f"Expect: 100-continue\r\nContent-Length: {len(body) + 10}\r\n\r\n") + body[:5]
    if choice == 10:  # a valid request, sometimes to the engine
        return http1_head(rng, f"Content-Length: {len(body)}\r\n\r\n") + body
    if choice == 11:
        return b"HTTP/1.1 200 OK\r\n\r\n"  # a response where a request belongs
    if choice == 12:
        return PREFACE[:rng.randrange(1, len(PREFACE))]
    return rng.randbytes(rng.randrange(1, 200))


def http1_connection_script(rng: random.Random) -> list[bytes | float]:
    """The bytes of one connection, split at random places, with pauses between some pieces."""
    data = b"".join(http1_fragment(rng) for _ in range(rng.randint(1, 3)))
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 4)))) if len(data) > 1 else []
    pieces: list[bytes | float] = []
    for start, end in zip([0, *cuts], [*cuts, len(data)]):
        pieces.append(data[start:end])
        if rng.random() < 0.3:
            pieces.append(rng.choice([0.01, 0.05, 0.1]))
    return pieces


def test_malformed_http1_framing_leaves_the_server_serving(smol_server):
    rng = random.Random(31)
    scripts = [http1_connection_script(rng) for _ in range(CONNECTIONS)]
    fuzz_in_batches(smol_server, scripts, lambda port, pieces: run_connection(port, b"", pieces, expect_upgrade=False))
