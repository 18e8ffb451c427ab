"""A client that leaves aborts every request it started, whatever the route, the shape and the moment.

One real `asyncengine serve` for the module, on a tiny Llama with a byte-level tokenizer (so text and
chat work), `--max-num-seqs 4`, of which one request holds at most half (docs/server.md, "Fairness"): a
request of four prompts (or n=4) then has two running and two waiting; the whole-response form's handler
is still before the status line (it waits for every prompt's final output), which is where a
multi-prompt request used to leave its requests running (issue 13, defect 2), and the stream's has
just sent it (it starts with the first prompt's first output). Requests ask
for far more tokens than they can generate before the client leaves, so "every request was
aborted" is read from the counters, not from timing: after each case nothing runs or waits, the KV
cache is empty, no request finished by length, and (where the requests were known to be in the
engine when the client left) the abort counter grew by their number. Clients are raw
sockets, so that each can leave at an exact point: before the status line, after it, mid-stream.
"""

from __future__ import annotations

import json
import shutil
import socket
import urllib.parse
import urllib.request

import pytest

from support.server import metric, requests_finished, start_server, wait_until
from support.tiny_models import build_tiny_model
from support.tiny_tokenizer import save_tiny_tokenizer

pytestmark = pytest.mark.slow

MAX_TOKENS = 1900  # never reached in a case: each ends with the client gone, in well under a second of generation
# An idle engine reports aborts at the next stats interval: a short one, so that the counters are soon current.
SERVER_OPTIONS = ["--max-model-len", "2048", "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(16 * 2**20),
                  "--stats-log-interval", "0.5"]
DEADLINE = 60.0  # for the server to reach a state; generous for a loaded machine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("disconnect-model")
    build_tiny_model("llama", directory, max_position_embeddings=2048)
    save_tiny_tokenizer(directory)
    running = start_server([str(directory), *SERVER_OPTIONS])
    yield running
    running.stop()


# -- the client side --------------------------------------------------------------------------------------


def completion(prompt, *, stream: bool) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}


def chat(n: int, *, stream: bool) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a long story."}], "n": n,
                                    "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}


def send_request(server, path: str, body: dict) -> socket.socket:
    url = urllib.parse.urlsplit(server.url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=DEADLINE)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_status_and_headers(reader) -> bytes:
    status = reader.readline()
    while reader.readline() not in (b"\r\n", b""):
        pass
    return status


def read_events(reader, count: int) -> list[dict]:
    events = []
    while len(events) < count:
        line = reader.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data: "):
            events.append(json.loads(line[6:]))
    return events


# -- the server side --------------------------------------------------------------------------------------


def in_engine(server, running: int, waiting: int = 0):
    return lambda: (metric(server, "num_requests_running"), metric(server, "num_requests_waiting")) == (running,
                                                                                                       waiting)


class Counts:
    def __init__(self, server) -> None:
        self.server = server
        self.length = requests_finished(server, "length")
        self.abort = requests_finished(server, "abort")

    def check_all_aborted(self, expected_aborts: int | None) -> None:
        """Nothing left running or waiting, the KV cache empty, no request run to its length (the
        client's were not: they were aborted), and at least `expected_aborts` more aborts when known
        (at least: a previous case's may be counted late, at the next stats interval)."""
        server = self.server
        wait_until(in_engine(server, 0, 0), "every request gone from the engine")
        wait_until(lambda: metric(server, "kv_cache_usage_perc") == 0, "the KV cache empty")
        if expected_aborts is not None:
            wait_until(lambda: requests_finished(server, "abort") - self.abort >= expected_aborts,
                       f"{expected_aborts} requests aborted")
        assert requests_finished(server, "length") == self.length, "a request of a client that left ran to its length"


def test_the_server_answers_after_every_case_and_first_a_normal_request(server):
    # A baseline that the cases below rely on: a finished request counts as "length" here.
    counts = Counts(server)
    body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    request = urllib.request.Request(server.base_url + "/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=DEADLINE) as response:
        assert json.loads(response.read())["choices"][0]["finish_reason"] == "length"
    wait_until(lambda: requests_finished(server, "length") == counts.length + 1, "the request counted")


# -- gone before the status line -----------------------------------------------------------------------------

SHAPES = {
    "completion": completion("Once upon a time", stream=False),
    "completion stream": completion("Once upon a time", stream=True),
    "completion of 4 prompts": completion(["a", "b", "c", "d"], stream=False),
    "completion stream of 4 prompts": completion(["a", "b", "c", "d"], stream=True),
    "completion stream of 2 token-id prompts": completion([[5, 6, 7], [8, 9]], stream=True),
    "chat": chat(1, stream=False),
    "chat stream": chat(1, stream=True),
    "chat n=2": chat(2, stream=False),
    "chat stream n=2": chat(2, stream=True),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_client_gone_right_after_sending_leaves_nothing_running(server, shape):
    # The client sends and closes at once: the server may see it gone before the requests reach the
    # engine or after; either way nothing of it may keep running.
    counts = Counts(server)
    path, body = SHAPES[shape]
    send_request(server, path, body).close()
    counts.check_all_aborted(None)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_four_prompts_two_running_two_waiting_before_the_status_line_are_all_aborted(server, stream):
    # Issue 13, defect 2: with two of the four prompts waiting for a slot (the request's share is two of
    # the four slots), the client leaves. Every one of the four must be aborted (the streaming form
    # left them all running: its producer tasks belonged to the app, not to the response).
    counts = Counts(server)
    sock = send_request(server, *completion(["a", "b", "c", "d"], stream=stream))
    wait_until(in_engine(server, 2, 2), "two prompts running and two waiting")
    sock.close()
    counts.check_all_aborted(4)


def test_chat_with_n_4_gone_with_two_running_and_two_waiting_is_all_aborted(server):
    counts = Counts(server)
    sock = send_request(server, *chat(4, stream=False))
    wait_until(in_engine(server, 2, 2), "two completions running and two waiting")
    sock.close()
    counts.check_all_aborted(4)


# -- gone after the status line, and mid-stream -------------------------------------------------------------

STREAMS = {  # shape -> (the request, its engine requests); two at most, so that all run at once
    "completion": (completion("Once upon a time", stream=True), 1),
    "completion of 2 prompts": (completion(["Once upon a time", "Long ago"], stream=True), 2),
    "chat": (chat(1, stream=True), 1),
    "chat n=2": (chat(2, stream=True), 2),
}


@pytest.mark.parametrize("shape", list(STREAMS))
@pytest.mark.parametrize("events", [0, 3], ids=["after the status line", "mid-stream"])
def test_a_stream_whose_client_leaves_is_aborted(server, shape, events):
    counts = Counts(server)
    (path, body), engine_requests = STREAMS[shape]
    sock = send_request(server, path, body)
    reader = sock.makefile("rb")
    assert read_status_and_headers(reader).startswith(b"HTTP/1.1 200")
    read_events(reader, events)
    wait_until(in_engine(server, engine_requests), f"{engine_requests} requests running")
    reader.close()
    sock.close()
    counts.check_all_aborted(engine_requests)


@pytest.mark.parametrize("shape", ["completion", "completion of 2 prompts", "chat n=2"])
def test_a_whole_response_whose_client_leaves_while_it_generates_is_aborted(server, shape):
    counts = Counts(server)
    path, body = {"completion": completion("Once upon a time", stream=False),
                  "completion of 2 prompts": completion(["Once upon a time", "Long ago"], stream=False),
                  "chat n=2": chat(2, stream=False)}[shape]
    sock = send_request(server, path, body)
    wait_until(in_engine(server, 2 if "2" in shape else 1), "the requests running")
    sock.close()
    counts.check_all_aborted(2 if "2" in shape else 1)
