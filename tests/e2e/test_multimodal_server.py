"""Images over HTTP with the official `openai` client against a real `asyncengine serve` (issue 38, acceptance 2).

One server for the module, a subprocess on a free port, serving a tiny random LLaVA with its real processor
(tests/support/vision_models.py) in float32, with tight media limits: at most 3 images a prompt, 64x64 pixels an
image, file:// URLs only under one folder, http(s) fetches only from 127.0.0.1, and a token budget of 24 a step so
that an image's 16 tokens are split across steps (the encoder cache holds images between them).

- data URLs of PNG, JPEG and WebP images, three in one message: the reply's tokens, whole and streamed, are the
  engine's own for the same conversation (`LLM.chat` in this process, on the same model);
- every bad image (truncated, wrong type, too many pixels, too many images, a host not allowed, a file outside the
  allowed folder) is a 400 whose `param` names the part, and a fuzz of mutated images through the client gets no
  5xx; the server still answers correctly after;
- an http image from an allowed host (a local one) is fetched, and its failures (404, a redirect, no reply within
  --media-fetch-timeout, bytes that are not HTTP) are 400s naming the part;
- a disconnect storm: many concurrent streaming image requests whose clients leave at every point (before the
  status line, mid-stream; raw sockets closed or reset, the client's own stream closed) leave nothing behind: no
  request running or waiting, the KV cache and the encoder cache empty (read from /metrics), every request
  aborted, no connection left half-open; a request that stays amid the storm, sharing its image with half of
  the storm's, gets the engine's own tokens, and so does one after it.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import random
import socket
import socketserver
import struct
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from PIL import Image

from support.mm_processors import default_tokenizer
from support.server import LISTEN, connection_states, launch_server, metric, requests_finished, wait_until
from support.vision_models import build_llava

MODEL = "tiny-vlm"
MAX_IMAGES = 3
DEADLINE = 60.0  # for the server to reach a state; generous for a loaded machine
FETCH_TIMEOUT = 1.5  # --media-fetch-timeout: ample for a local fetch on a loaded machine
STORM_MAX_TOKENS = 900  # never reached: each storm client leaves within a few tokens


def encoded(width: int, height: int, seed: int, image_format: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format=image_format)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def conversation(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Compare:"}, *parts]}]


# Three images of different sizes and formats in one message (the server's limit), with text between.
THREE_IMAGES = conversation(
    image_part(data_url(encoded(30, 20, 1, "PNG"))), {"type": "text", "text": "with"},
    image_part(data_url(encoded(16, 40, 2, "JPEG"), "image/jpeg")), {"type": "text", "text": "and"},
    image_part(data_url(encoded(48, 32, 3, "WEBP"), "image/webp")))
REPLY_TOKENS = 8


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    tokenizer_dir = tmp_path_factory.mktemp("smollm2-tokenizer")
    default_tokenizer().save_pretrained(str(tokenizer_dir))
    return build_llava(tmp_path_factory.mktemp("tiny-llava"), tokenizer_dir).path


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "cat.png").write_bytes(encoded(20, 20, 4))
    (root / "secret.png").write_bytes(encoded(20, 20, 5))
    return root


@pytest.fixture(scope="module")
def served(vlm_dir, media):
    """The server, and the engine's own reply to THREE_IMAGES computed in this process while the server starts."""
    launched = launch_server([
        str(vlm_dir), "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "1024",
        "--kv-cache-memory-bytes", str(16 * 2**20), "--max-num-seqs", "8", "--max-num-batched-tokens", "24",
        "--limit-mm-per-prompt", json.dumps({"image": MAX_IMAGES}), "--max-image-pixels", str(64 * 64),
        "--allowed-local-media-path", str(media / "allowed"), "--allowed-media-domains", "127.0.0.1",
        "--media-fetch-timeout", str(FETCH_TIMEOUT), "--stats-log-interval", "0.5"])
    try:
        reply = engines_own_reply(vlm_dir)
        running = launched.wait_until_serving()
    except BaseException:
        launched.process.kill()
        launched.process.wait()
        raise
    yield running, reply
    assert running.stop() == 0, running.stderr()[-3000:]
    # nothing failed out of sight either: no bad image, fetch or disconnect left a traceback in the server's log
    assert "Traceback" not in running.stderr(), running.stderr()[-5000:]


def engines_own_reply(vlm_dir) -> tuple[list[int], int]:
    """The engine's greedy tokens for THREE_IMAGES and its prompt's length, from LLM.chat in this process (the
    same model and dtype as the server's)."""
    from asyncengine import LLM, SamplingParams

    with LLM(model=str(vlm_dir), dtype="float32", max_model_len=1024, kv_cache_memory_bytes=8 * 2**20,
             limit_mm_per_prompt={"image": MAX_IMAGES}) as llm:
        (output,) = llm.chat(THREE_IMAGES, SamplingParams(temperature=0, max_tokens=REPLY_TOKENS, ignore_eos=True))
    return list(output.outputs[0].token_ids), len(output.prompt_token_ids)


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def engine_reply(served):
    return served[1]


@pytest.fixture(scope="module")
def client(server):
    # max_retries=0: a 5xx would be retried, and hidden, otherwise
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=DEADLINE) as client:
        yield client


REPLY_OPTIONS = dict(model=MODEL, temperature=0, max_tokens=REPLY_TOKENS, logprobs=True,
                     extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})


def token_ids(logprobs_content) -> list[int]:
    return [int(entry.token.removeprefix("token_id:")) for entry in logprobs_content]


def reply_tokens(client) -> tuple[list[int], int]:
    reply = client.chat.completions.create(messages=THREE_IMAGES, **REPLY_OPTIONS)
    return token_ids(reply.choices[0].logprobs.content), reply.usage.prompt_tokens


def test_png_jpeg_webp_data_urls_in_one_message_give_the_engines_own_tokens(client, engine_reply):
    expected, prompt_tokens = engine_reply
    assert len(expected) == REPLY_TOKENS
    assert reply_tokens(client) == (expected, prompt_tokens)
    # Streamed: the same tokens, over several chunks.
    stream = client.chat.completions.create(messages=THREE_IMAGES, stream=True, **REPLY_OPTIONS)
    streamed, chunks = [], 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += token_ids(chunk.choices[0].logprobs.content)
            chunks += 1
    assert streamed == expected and chunks > 1


def test_an_allowed_file_url_is_read(client, media):
    reply = client.chat.completions.create(model=MODEL, messages=conversation(image_part(
        f"file://{media}/allowed/cat.png")), max_tokens=2, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 2


def good_part(seed: int = 7) -> dict:
    return image_part(data_url(encoded(8, 8, seed)))


class ImageHost(socketserver.ThreadingTCPServer):
    """An http host the server may fetch from (127.0.0.1), answering by path: an image, a 404, a redirect, a
    reply that never comes, bytes that are not HTTP."""

    daemon_threads = True
    allow_reuse_address = True
    IMAGE = encoded(20, 20, 11)
    REPLIES = {
        "/cat.png": b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: %d\r\n\r\n" % len(IMAGE) + IMAGE,
        "/missing.png": b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n",
        "/moved.png": b"HTTP/1.1 302 Found\r\nLocation: /cat.png\r\nContent-Length: 0\r\n\r\n",
        "/garbage.png": b"SSH-2.0-OpenSSH\r\n\r\n",
    }

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), self.Handler)

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            path = self.rfile.readline().split()[1].decode()
            while self.rfile.readline() not in (b"\r\n", b""):
                pass
            if path == "/slow.png":
                time.sleep(FETCH_TIMEOUT + 2)  # the server has given up and closed by then
            with contextlib.suppress(OSError):
                self.wfile.write(ImageHost.REPLIES.get(path, b""))


@pytest.fixture(scope="module")
def image_host():
    host = ImageHost()
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{host.server_address[1]}"
    host.shutdown()
    host.server_close()


def test_http_images_from_an_allowed_host_are_fetched_and_every_failure_is_a_400(client, image_host):
    reply = client.chat.completions.create(model=MODEL, messages=conversation(image_part(image_host + "/cat.png")),
                                           max_tokens=2, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 2
    for path, words in [("/missing.png", "answered HTTP 404"), ("/moved.png", "redirects are not followed"),
                        ("/slow.png", f"took longer than {FETCH_TIMEOUT:g} s"), ("/garbage.png", "could not fetch")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=conversation(good_part(), image_part(
                image_host + path)), max_tokens=1)
        assert words in info.value.body["message"], (path, info.value.body)
        assert info.value.body["param"] == "messages[0].content[2].image_url", info.value.body


# -- bad images ---------------------------------------------------------------------------------------------

# Each bad case: the message's parts after the leading text, the index of the part to blame, words of the message.
BAD = {
    "truncated": ([good_part(), image_part(data_url(encoded(20, 20, 6)[:80]))], 2, "truncated"),
    "wrong type: text in a data URL": ([image_part(data_url(b"hello", "text/plain"))], 1, "not an image"),
    "wrong type: bytes that are no image": ([image_part(data_url(b"GIF89a but not really"))], 1, "not an image"),
    "wrong type: an image format not read": ([image_part(data_url(encoded(8, 8, 8, "TIFF"), "image/tiff"))], 1,
                                             "not an image"),
    "too many pixels": ([good_part(), image_part(data_url(encoded(65, 64, 9)))], 2, "pixels"),
    "host not allowed": ([image_part("https://example.com/cat.png")], 1, "not allowed"),
    "file outside the allowed folder": ([good_part(), image_part("file://{media}/allowed/../secret.png")], 2,
                                        "outside the allowed"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_image_is_a_400_naming_the_part(client, media, case):
    parts, blamed, words = BAD[case]
    parts = [json.loads(json.dumps(part).replace("{media}", str(media))) for part in parts]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=conversation(*parts), max_tokens=1)
    error = info.value.body
    assert info.value.status_code == 400 and words in error["message"], error
    assert error["param"] == f"messages[0].content[{blamed}].image_url", error


def test_too_many_images_is_a_400_naming_the_part_over_the_limit(client):
    parts = [good_part(seed) for seed in range(MAX_IMAGES + 1)]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=conversation(*parts), max_tokens=1)
    error = info.value.body
    assert f"over the limit of {MAX_IMAGES}" in error["message"], error
    assert error["param"] == f"messages[0].content[{MAX_IMAGES + 1}]", error


def mutated_part(rng: random.Random, media) -> dict:
    """An image part the fuzz makes: a good PNG, JPEG or WebP with bytes changed or cut, a data URL with a wrong
    type or bad base64, a path out of the folder, a host not allowed, or a malformed part."""
    image_format = rng.choice(["PNG", "JPEG", "WEBP"])
    data = bytearray(encoded(rng.randint(4, 40), rng.randint(4, 40), rng.randrange(100), image_format))
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    media_type = f"image/{image_format.lower()}"
    url = rng.choice([
        data_url(bytes(data), media_type), data_url(bytes(data[:rng.randrange(len(data))]), media_type),
        data_url(encoded(rng.randint(65, 300), rng.randint(65, 300), 1), media_type),  # too many pixels
        data_url(bytes(data), rng.choice(["text/html", "application/octet-stream", "image/svg+xml"])),
        "data:image/png;base64," + "".join(rng.choice("AB=+/@ \n") for _ in range(rng.randint(0, 60))),
        f"file://{media}/{'../' * rng.randint(0, 4)}secret.png", "file:///etc/passwd",
        f"{rng.choice(['http', 'https'])}://{rng.choice(['example.com', 'localhost', '10.0.0.1', '[::1]'])}/a.png",
        rng.choice(["ftp://127.0.0.1/a.png", "cat.png", "", "data:", "file://", "http://"]),
    ])
    if rng.random() < 0.15:
        return rng.choice([{"type": "image"}, {"type": "image_pil", "image_pil": "x"}, {"type": "image_embeds"},
                           {"type": "image_url", "image_url": rng.choice([None, 7, "x", {"url": None}, []])}])
    return image_part(url)


def test_a_fuzz_of_bad_images_through_the_client_gets_no_5xx(client, media, engine_reply):
    rng = random.Random(38)
    statuses: dict[int, int] = {}
    for _ in range(60):
        parts = [mutated_part(rng, media) for _ in range(rng.randint(1, MAX_IMAGES + 1))]
        try:
            client.chat.completions.create(model=MODEL, messages=conversation(*parts), max_tokens=1)
            status = 200
        except openai.APIStatusError as error:
            status = error.status_code
            assert status < 500, error.body
            assert error.body["param"].startswith("messages[0].content["), error.body  # the part is named
        statuses[status] = statuses.get(status, 0) + 1
    assert statuses.get(400, 0) >= 50, statuses
    # still serving, and correctly
    assert reply_tokens(client) == engine_reply


# -- the disconnect storm -----------------------------------------------------------------------------------

SHARED_PART = THREE_IMAGES[0]["content"][1]  # THREE_IMAGES' PNG


def storm_body(index: int) -> bytes:
    """A streaming request with the PNG of THREE_IMAGES (half of the storm's requests, in every way of leaving:
    one encoder-cache entry and prefix-cache blocks shared with each other and with the request that stays), or
    one or two images of its own (distinct entries)."""
    if (index // 3) % 2 == 0:
        parts = [SHARED_PART]
    else:
        parts = [image_part(data_url(encoded(24 + index % 9, 20, 1000 + 2 * index + k))) for k in range(1 + index % 2)]
    return json.dumps({"model": MODEL, "messages": conversation(*parts), "stream": True, "ignore_eos": True,
                       "max_tokens": STORM_MAX_TOKENS}).encode()


def client_that_stays(server) -> tuple[list[int], int]:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=DEADLINE) as client:
        return reply_tokens(client)


def raw_client(server, index: int, leave: str) -> None:
    """A raw-socket client that leaves at `leave`: right after its request ("sent"), after the status line
    ("status"), or after three events ("events"); by a close, or (odd clients) a reset (SO_LINGER 0: an RST,
    no FIN)."""
    url = urllib.parse.urlsplit(server.url)
    body = storm_body(index)
    sock = socket.create_connection((url.hostname, url.port), timeout=DEADLINE)
    try:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        reader = sock.makefile("rb")
        if leave in ("status", "events"):
            status = reader.readline()
            assert status.startswith(b"HTTP/1.1 200"), status
        if leave == "events":
            events = 0
            while events < 3:
                line = reader.readline()
                assert line, "the stream ended early"
                events += line.startswith(b"data: ")
        if index % 2:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()


def client_that_closes_its_stream(server, index: int) -> None:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=DEADLINE) as client:
        request = json.loads(storm_body(index))
        stream = client.chat.completions.create(model=MODEL, messages=request["messages"], stream=True,
                                                max_tokens=STORM_MAX_TOKENS, extra_body={"ignore_eos": True})
        for count, _ in enumerate(stream):
            if count == 2:
                break
        stream.close()


def test_a_disconnect_storm_leaves_the_kv_and_encoder_caches_empty(server, client, engine_reply):
    leaves = ["sent", "status", "events"]
    jobs = [(raw_client, (server, index, leaves[index % 3])) for index in range(18)]
    jobs += [(client_that_closes_its_stream, (server, 100 + index)) for index in range(6)]
    aborted_before, length_before = requests_finished(server, "abort"), requests_finished(server, "length")
    port = urllib.parse.urlsplit(server.url).port
    busiest = {"encoder_cache_entries": 0.0, "num_requests_running": 0.0}
    with ThreadPoolExecutor(len(jobs) + 1) as pool:
        futures = [pool.submit(job, *args) for job, args in jobs]
        staying = pool.submit(client_that_stays, server)  # amid the storm, with the image it shares
        while not all(future.done() for future in futures):  # what the storm held at its height (printed)
            for name in busiest:
                busiest[name] = max(busiest[name], metric(server, name))
            time.sleep(0.05)
        for future in futures:
            future.result()
        assert staying.result() == engine_reply
    print(f"during the storm, at most: {busiest}")
    wait_until(lambda: (metric(server, "num_requests_running"), metric(server, "num_requests_waiting")) == (0, 0),
               "every request gone from the engine")
    wait_until(lambda: metric(server, "kv_cache_usage_perc") == 0, "the KV cache empty")
    wait_until(lambda: (metric(server, "encoder_cache_entries"), metric(server, "encoder_cache_rows")) == (0, 0),
               "the encoder cache empty")
    # Every request was aborted, none ran to its length. A client that left before its request reached the
    # engine has no request to abort: at least the ones that had seen their stream begin ("status", "events" and
    # the client's own streams) were in it.
    in_engine = sum(1 for job, args in jobs if job is client_that_closes_its_stream or args[2] != "sent")
    wait_until(lambda: requests_finished(server, "abort") - aborted_before >= in_engine,
               f"{in_engine} requests aborted")
    wait_until(lambda: requests_finished(server, "length") > length_before, "the staying request counted")
    assert requests_finished(server, "length") == length_before + 1, "a request whose client left ran to its length"
    # No storm connection left open by the server (established or half-closed): besides its listening socket, at
    # most the module client's kept-alive one.
    wait_until(lambda: sum(state != LISTEN for state in connection_states(server.process.pid, port)) <= 1,
               "the storm clients' connections closed")
    assert reply_tokens(client) == engine_reply
