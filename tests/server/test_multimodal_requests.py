"""Images over the chat API (issue 38's frontend side), in-process (tests/support/in_process_server.py): image_url
parts with data URLs reach the engine as the expanded prompt, and every bad image is a 400 in OpenAI's shape
naming the part, with no 5xx in a fuzz run.

The model is a tiny random LLaVA with its real processor (tests/support/vision_models.py, on SmolLM2's tokenizer
from tests/support/mm_processors.py): the whole path runs, from the request's image parts to the vision tower."""

from __future__ import annotations

import base64
import io
import json
import random

import numpy as np
import pytest
from PIL import Image

from asyncengine import RequestError
from asyncengine.server.config import ServerConfig
from support.in_process_server import in_process_server
from support.mm_processors import default_tokenizer
from support.vision_models import build_llava

MODEL = "tiny-vlm"
HEADERS = {"Content-Type": "application/json"}


def png(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def png_image() -> Image.Image:
    return Image.open(io.BytesIO(png(20, 20)))


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*parts: dict, **fields) -> dict:
    return {"model": MODEL, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"}, *parts]}], **fields}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "cat.png").write_bytes(png(20, 20))
    (root / "secret.png").write_bytes(png(20, 20))
    (root / "allowed" / "link.png").symlink_to(root / "secret.png")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, media):
    tokenizer_dir = tmp_path_factory.mktemp("smollm2-tokenizer")
    default_tokenizer().save_pretrained(str(tokenizer_dir))
    vlm = build_llava(tmp_path_factory.mktemp("tiny-llava"), tokenizer_dir)
    directory = vlm.path
    options = {"model": str(directory), "served_model_name": MODEL, "max_model_len": 256,
               "kv_cache_memory_bytes": 4 * 2**20, "limit_mm_per_prompt": {"image": 2}, "max_image_pixels": 64 * 64,
               "allowed_local_media_path": str(media / "allowed"), "allowed_media_domains": ["127.0.0.1"],
               "media_fetch_timeout": 0.5}
    with in_process_server(options, ServerConfig()) as running:
        running.media_dir = media / "allowed"
        running.image_token_id = vlm.image_token_id
        alone = vlm.processor(text=["<image>"], images=[png_image()])["input_ids"][0]
        running.tokens_per_image = list(alone).count(vlm.image_token_id)
        yield running


def send(server, body) -> tuple[int, dict]:
    status, _, raw = server.request("POST", "/v1/chat/completions", body, HEADERS)
    return status, json.loads(raw)


def test_data_url_images_reach_the_engine_as_the_expanded_prompt(server):
    status, body = send(server, chat(image_part(data_url(png(30, 20, 1))), {"type": "text", "text": "and"},
                                     image_part(data_url(png(16, 40, 2)))))
    assert status == 200, body
    # the same conversation with a one-token word where each image was: each image's one placeholder became its
    # tokens (32x32 pixels in 8-pixel patches: 16)
    word = {"type": "text", "text": "X"}
    text_only = send(server, chat(word, {"type": "text", "text": "and"}, word))[1]
    assert body["usage"]["prompt_tokens"] - text_only["usage"]["prompt_tokens"] == 2 * (server.tokens_per_image - 1)
    status, body = send(server, chat(image_part(f"file://{server.media_dir}/cat.png")))  # under the allowed folder
    assert status == 200, body
    status, _, raw = server.request("POST", "/v1/chat/completions",
                                    chat(image_part(data_url(png(30, 20, 1))), stream=True, max_tokens=2), HEADERS)
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]" and len(events) >= 2, raw


BAD = {
    "truncated": (lambda media: data_url(png(20, 20)[:60]), "truncated"),
    "wrong type": (lambda media: "data:image/png;base64," + base64.b64encode(b"GIF89a not really").decode(),
                   "not an image"),
    "too many pixels": (lambda media: data_url(png(100, 100)), "pixels"),
    "url not allowed": (lambda media: "https://example.com/cat.png", "not allowed"),
    "outside the folder": (lambda media: f"file://{media}/secret.png", "outside the allowed"),
    "symlink out of the folder": (lambda media: f"file://{media}/allowed/link.png", "outside the allowed"),
    "not a url": (lambda media: "cat.png", "data:, file:// or http"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_bad_image_is_a_400_naming_the_part(server, media, case):
    make_url, words = BAD[case]
    status, body = send(server, chat(image_part(data_url(png(8, 8))), image_part(make_url(media))))
    assert status == 400, body
    assert words in body["error"]["message"], body
    assert body["error"]["param"] == "messages[0].content[2].image_url", body


def test_too_many_images_is_a_400_before_any_is_read(server):
    status, body = send(server, chat(*[image_part(data_url(png(8, 8, seed))) for seed in range(3)]))
    assert status == 400 and "over the limit of 2" in body["error"]["message"], body
    assert body["error"]["param"] == "messages[0].content[3]"


def test_image_parts_fuzzed_are_never_a_5xx(server):
    rng = random.Random(38)
    good = png(12, 12)
    statuses = {}
    for _ in range(40):
        data = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        url = rng.choice([data_url(bytes(data)), data_url(bytes(data[:rng.randrange(len(data))])),
                          "data:image/png;base64," + "".join(rng.choice("AB=+/@") for _ in range(rng.randint(0, 40))),
                          f"file:///{'../' * rng.randint(0, 5)}etc/passwd", "http://127.0.0.1:9/x.png",
                          {"no": "url"}, rng.choice([None, 3, [], ""])])
        part = {"type": "image_url", "image_url": url if not isinstance(url, str) else {"url": url}}
        if rng.random() < 0.2:
            part = {"type": "image_url", "image_url": rng.choice([None, 7, "x", {"url": None}])}
        status, body = send(server, chat(part))
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, body
    assert statuses.get(400, 0) > 20, statuses


def test_multi_modal_data_prompts_in_the_python_api(server):
    """AsyncEngine (what LLM wraps): a prompt's multi_modal_data is processed in the tokenizer pool into the
    expanded prompt and one feature per image, sent with the request, and the request runs."""
    from asyncengine import SamplingParams

    images = [Image.open(io.BytesIO(png(30, 20, 1))), np.array(Image.open(io.BytesIO(png(16, 40, 2))))]
    prompt = {"prompt": "<image> then <image>?", "multi_modal_data": {"image": images}}
    processed = server.call(server.engine.process_request_async, prompt, SamplingParams(max_tokens=1))
    features = processed.children[0].mm_features
    count = server.tokens_per_image
    assert [f.position.length for f in features] == [count] * 2 and features[0].identifier != features[1].identifier
    for feature in features:
        start = feature.position.offset
        assert processed.prompt_token_ids[start:start + count] == [server.image_token_id] * count

    async def generate():
        return [output async for output in server.engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0))]

    outputs = server.call(generate)
    assert outputs[-1].finished and outputs[-1].prompt_token_ids == processed.prompt_token_ids
    with pytest.raises(RequestError, match="over the limit of 2") as info:
        server.call(server.engine.process_request_async, {"prompt": "<image>" * 3,
                                                          "multi_modal_data": {"image": images + images[:1]}})
    assert info.value.field == "multi_modal_data.image"



def test_image_work_never_holds_up_text_requests(server):
    """Images are decoded and processed in a pool of their own (AsyncEngine.media_pool): with every thread of it
    busy (a burst of large images), a text request is still tokenized and answered."""
    import threading

    import anyio

    release = threading.Event()
    pool = server.engine.media_pool

    async def text_request_while_the_media_pool_is_full():
        async with anyio.create_task_group() as tg:
            for _ in range(pool.size):
                tg.start_soon(pool.run, release.wait, 60)
            try:
                while pool.limiter.borrowed_tokens < pool.size:
                    await anyio.sleep(0.01)
                with anyio.fail_after(30):
                    return await server.engine.chat_prompt([{"role": "user", "content": "hello"}])
            finally:
                release.set()

    prompt = server.call(text_request_while_the_media_pool_is_full)
    assert prompt["prompt_token_ids"] and "hello" in prompt["prompt"]
