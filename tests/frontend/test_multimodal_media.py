"""Images from requests (frontend/media.py, chat_images.py): every bad image is a RequestError naming its part,
never another exception; data URLs, local files under the allowed folder only, fetches from allowed hosts only
(bounded in bytes and time, over a real local socket); content hashes."""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib
from pathlib import Path

import anyio
import anyio.abc
import numpy as np
import pytest
import torch
from PIL import Image

from asyncengine.errors import RequestError
from asyncengine.frontend.chat_images import load_chat_images
from asyncengine.frontend.media import (
    MediaLimits,
    decode_image,
    image_bytes_from_url,
    image_from_object,
    image_identifier,
    parse_data_url,
)

WHERE = "messages[0].content[1].image_url"


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def noise(width: int = 40, height: int = 30, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def refused(call, *args, where: str = WHERE) -> str:
    with pytest.raises(RequestError) as info:
        call(*args)
    assert info.value.field is not None and info.value.field.startswith(where), info.value.field
    return str(info.value)


def png_announcing(width: int, height: int) -> bytes:
    """A PNG whose header announces width x height (valid CRC), with a tiny, wrong body: a decompression bomb's
    first bytes."""
    data = encoded(noise(4, 4))
    ihdr = struct.pack(">II", width, height) + data[24:29]
    chunk = b"IHDR" + ihdr
    return data[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + data[33:]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_data_urls_of_each_format_decode_to_rgb(fmt):
    image = noise()
    decoded = decode_image(parse_data_url(data_url(encoded(image, fmt), f"image/{fmt.lower()}"), MediaLimits(), WHERE),
                           MediaLimits(), WHERE)
    assert decoded.mode == "RGB" and decoded.size == image.size
    if fmt == "PNG":  # lossless: the same pixels
        assert decoded.tobytes() == image.tobytes()


def test_transparency_is_composited_over_white():
    image = Image.new("RGBA", (2, 1), (0, 0, 0, 0))
    assert decode_image(encoded(image), MediaLimits(), WHERE).getpixel((0, 0)) == (255, 255, 255)


def test_bad_data_urls_name_the_part():
    limits = MediaLimits(max_image_bytes=1000)
    assert "base64" in refused(parse_data_url, "data:image/png,abc", limits, WHERE)
    assert "does not decode" in refused(parse_data_url, "data:image/png;base64,@@@", limits, WHERE)
    assert "not an image" in refused(parse_data_url, data_url(b"x", "text/plain"), limits, WHERE)
    assert "over the limit" in refused(parse_data_url, data_url(bytes(2000)), limits, WHERE)
    assert "data:, file:// or http" in refused(anyio.run, image_bytes_from_url, "ftp://x/y.png", limits, WHERE)


def test_bad_images_name_the_part():
    png = encoded(noise())
    assert "truncated" in refused(decode_image, png[: len(png) // 2], MediaLimits(), WHERE)
    assert "not an image" in refused(decode_image, b"%PDF-1.4 not an image at all", MediaLimits(), WHERE)
    assert "not an image" in refused(decode_image, encoded(noise(), "TIFF"), MediaLimits(), WHERE)  # not a format read
    assert "pixels" in refused(decode_image, png, MediaLimits(max_image_pixels=100), WHERE)
    assert "bytes" in refused(decode_image, png, MediaLimits(max_image_bytes=100), WHERE)


def test_a_decompression_bomb_is_refused_from_its_header():
    bomb = png_announcing(100_000, 100_000)  # 10 gigapixels announced in a few bytes
    message = refused(decode_image, bomb, MediaLimits(), WHERE)
    assert "10000000000 pixels" in message and f"limit of {4096 * 4096} (--max-image-pixels)" in message
    # under our limit but over PIL's own guard: still a 400, not a 500, naming the guard
    assert "pillow's decompression-bomb limit" in refused(decode_image, png_announcing(20_000, 20_000),
                                                          MediaLimits(max_image_pixels=10**9), WHERE)


def test_fuzzed_images_are_request_errors_or_images():
    rng = random.Random(38)
    seeds = [encoded(noise(16, 12), fmt) for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP")]
    outcomes = {"image": 0, "refused": 0}
    for _ in range(300):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):
            if not data:
                break
            action = rng.random()
            position = rng.randrange(len(data))
            if action < 0.6:
                data[position] = rng.randrange(256)
            elif action < 0.8:
                del data[position:]
            else:
                data[position:position] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        try:
            image = decode_image(bytes(data), MediaLimits(max_image_pixels=1 << 20), WHERE)
        except RequestError as exc:
            assert exc.field == WHERE
            outcomes["refused"] += 1
        else:
            assert image.mode == "RGB"
            outcomes["image"] += 1
    assert outcomes["refused"] > 50 and outcomes["image"] > 0, outcomes


def test_local_files_only_under_the_allowed_folder(tmp_path: Path):
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir()
    outside.mkdir()
    png = encoded(noise())
    (allowed / "cat.png").write_bytes(png)
    (outside / "key.png").write_bytes(png)
    (allowed / "link.png").symlink_to(outside / "key.png")
    limits = MediaLimits(allowed_local_media_path=str(allowed))

    def read(url: str, limits: MediaLimits = limits) -> bytes:
        return anyio.run(image_bytes_from_url, url, limits, WHERE)

    assert read(f"file://{allowed}/cat.png") == png
    assert "outside the allowed" in refused(read, f"file://{outside}/key.png")
    assert "outside the allowed" in refused(read, f"file://{allowed}/../secret/key.png")
    assert "outside the allowed" in refused(read, f"file://{allowed}/link.png")  # symlinks resolved
    assert "cannot read" in refused(read, f"file://{allowed}/missing.png")
    assert "--allowed-local-media-path" in refused(read, f"file://{allowed}/cat.png", MediaLimits())
    assert "no host" in refused(read, f"file://example.com{allowed}/cat.png")


def answering(response: bytes | None):
    """A connection handler that answers with `response` (None: never answers)."""

    async def handle(stream) -> None:
        async with stream:
            await stream.receive()
            if response is None:
                await anyio.sleep_forever()
            await stream.send(response)

    return handle


def http_response(status: str, body: bytes, headers: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{headers}Connection: close\r\n\r\n".encode() + body


@pytest.mark.anyio
async def test_fetches_from_allowed_hosts_bounded_in_bytes_and_time():
    png = encoded(noise())
    limits = MediaLimits(allowed_media_domains=("127.0.0.1",), fetch_timeout=0.5, max_image_bytes=len(png) + 10)
    cases = [(http_response("200 OK", png), None), (http_response("404 Not Found", b""), "HTTP 404"),
             (http_response("302 Found", b"", "Location: http://elsewhere/x.png\r\n"), "redirects are not followed"),
             (http_response("200 OK", bytes(len(png) + 100)), "over the limit"), (None, "longer than 0.5 s")]
    for response, error in cases:
        async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
            port = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, answering(response))
                try:
                    data = await image_bytes_from_url(f"http://127.0.0.1:{port}/cat.png", limits, WHERE)
                except RequestError as exc:
                    assert error is not None and error in str(exc) and exc.field == WHERE, (error, exc)
                else:
                    assert error is None and data == png
                tg.cancel_scope.cancel()
    with pytest.raises(RequestError, match="not allowed.*--allowed-media-domains") as info:
        await image_bytes_from_url("https://example.com/cat.png", MediaLimits(), WHERE)
    assert info.value.field == WHERE
    with pytest.raises(RequestError, match="not allowed"):  # an allowed domain's look-alike
        await image_bytes_from_url("http://127.0.0.1.evil.example/cat.png", limits, WHERE)


@pytest.mark.anyio
async def test_a_fetch_is_cancelled_with_its_request():
    limits = MediaLimits(allowed_media_domains=("127.0.0.1",), fetch_timeout=30)
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, answering(None))  # a server that never answers
            started = anyio.current_time()
            with anyio.move_on_after(0.2) as scope:  # the request goes away (a client disconnect)
                await image_bytes_from_url(f"http://127.0.0.1:{port}/slow.png", limits, WHERE)
            assert scope.cancelled_caught and anyio.current_time() - started < 5
            tg.cancel_scope.cancel()


def test_python_objects_become_rgb_images():
    image = noise()
    array = np.array(image)
    where = "multi_modal_data.image[0]"
    for item in (image, array, torch.from_numpy(array).permute(2, 0, 1), torch.from_numpy(array / 255.0).permute(2, 0, 1),
                 encoded(image)):
        converted = image_from_object(item, MediaLimits(), where)
        assert converted.mode == "RGB" and converted.tobytes() == image.tobytes(), type(item)
    assert "embeddings" in refused(image_from_object, torch.zeros(16, 64), MediaLimits(), where, where=where)
    assert "[0, 1]" in refused(image_from_object, np.full((4, 4, 3), 2.0), MediaLimits(), where, where=where)
    assert "PIL.Image" in refused(image_from_object, "cat.png", MediaLimits(), where, where=where)
    assert "pixels" in refused(image_from_object, np.zeros((100, 100, 3), np.uint8), MediaLimits(max_image_pixels=99),
                               where, where=where)


def test_the_identifier_is_the_pixels_and_the_options():
    image = noise()
    same = decode_image(encoded(image), MediaLimits(), WHERE)
    assert image_identifier(image, {}, "p") == image_identifier(same, {}, "p")
    assert image_identifier(image, {}, "p") != image_identifier(noise(seed=1), {}, "p")
    assert image_identifier(image, {}, "p") != image_identifier(image.resize((30, 40)), {}, "p")
    assert image_identifier(image, {}, "p") != image_identifier(image, {"do_image_splitting": False}, "p")


@pytest.mark.anyio
async def test_chat_image_parts_are_loaded_in_order_and_counted_first():
    first, second = noise(seed=1), noise(seed=2)

    async def run_in_thread(function, *args):
        return await anyio.to_thread.run_sync(function, *args)

    messages = [{"role": "user", "content": [
        {"type": "text", "text": "compare"}, {"type": "image_url", "image_url": {"url": data_url(encoded(first))}},
        {"type": "image_url", "image_url": data_url(encoded(second))}, {"type": "image_pil", "image_pil": first}]}]
    rewritten, images = await load_chat_images(messages, MediaLimits(), 3, run_in_thread)
    assert [image.tobytes() for image in images] == [first.tobytes(), second.tobytes(), first.tobytes()]
    assert rewritten[0]["content"][1:] == [{"type": "image"}] * 3
    assert messages[0]["content"][1]["type"] == "image_url"  # the caller's messages are left alone
    with pytest.raises(RequestError, match="3 images, over the limit of 1") as info:
        await load_chat_images(messages, MediaLimits(), 1, run_in_thread)
    assert info.value.field == "messages[0].content[2]"
    broken = [{"role": "user", "content": [{"type": "text", "text": "x"},
                                           {"type": "image_url", "image_url": {"url": data_url(b"nope")}}]}]
    with pytest.raises(RequestError, match="not an image") as info:
        await load_chat_images(broken, MediaLimits(), 2, run_in_thread)
    assert info.value.field == WHERE
    with pytest.raises(RequestError, match="embeddings"):
        await load_chat_images([{"role": "user", "content": [{"type": "image_embeds", "image_embeds": "x"}]}],
                               MediaLimits(), 2, run_in_thread)
    # A bare {"type": "image"} part (what templates render) from a client: a placeholder with no image behind it.
    with pytest.raises(RequestError, match="carries no image: send the image as an image_url part") as info:
        await load_chat_images([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image"}]}],
                               MediaLimits(), 2, run_in_thread)
    assert info.value.field == "messages[0].content[1].type"
    # OpenAI's detail: taken (without effect) when it is one of OpenAI's values, else named
    detailed = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(encoded(first)),
                                                                              "detail": "low"}}]}]
    assert len((await load_chat_images(detailed, MediaLimits(), 2, run_in_thread))[1]) == 1
    detailed[0]["content"][0]["image_url"]["detail"] = 7
    with pytest.raises(RequestError, match="detail must be one of auto, low, high, got 7") as info:
        await load_chat_images(detailed, MediaLimits(), 2, run_in_thread)
    assert info.value.field == "messages[0].content[0].image_url.detail"


def test_image_parts_reach_templates_in_their_content_format():
    from asyncengine.frontend.chat_messages import conversation_for_template

    messages = [{"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "image"},
                                             {"type": "text", "text": "?"}]}]
    string_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    parts_template = "{% for m in messages %}{% for p in m['content'] %}{{ p['type'] }}{% endfor %}{% endfor %}"
    assert conversation_for_template(messages, string_template, image_placeholder="<image>")[0]["content"] == \
        "what is\n<image>\n?"
    assert conversation_for_template(messages, parts_template, image_placeholder="<image>")[0]["content"] == [
        {"type": "text", "text": "what is"}, {"type": "image"}, {"type": "text", "text": "?"}]
    raw = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(RequestError, match="takes no images") as info:  # a model that is not multimodal
        conversation_for_template(raw, parts_template)
    assert info.value.field == "messages[0].content[0].type"


def test_the_multimodal_flags_parse_and_bad_values_name_their_field():
    import argparse

    from asyncengine import EngineConfig
    from asyncengine.cli.args import add_engine_arguments, engine_config_from_args
    from asyncengine.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args([
        "--limit-mm-per-prompt", '{"image": 2}', "--allowed-media-domains", "a.example", "b.example",
        "--allowed-local-media-path", "/srv/media", "--max-image-pixels", "1000", "--mm-processor-kwargs",
        '{"do_image_splitting": false}']), model=None)
    limits = MediaLimits.of(config)
    assert config.limit_mm_per_prompt == {"image": 2} and config.mm_processor_kwargs == {"do_image_splitting": False}
    assert limits.allowed_media_domains == ("a.example", "b.example") and limits.max_image_pixels == 1000
    assert limits.allowed_local_media_path == "/srv/media"
    for options, field in [({"limit_mm_per_prompt": {"video": 1}}, "limit_mm_per_prompt"),
                           ({"limit_mm_per_prompt": {"image": -1}}, "limit_mm_per_prompt"),
                           ({"max_image_pixels": 0}, "max_image_pixels"),
                           ({"media_fetch_timeout": 0.0}, "media_fetch_timeout"),
                           ({"mm_processor_cache_gb": float("nan")}, "mm_processor_cache_gb"),
                           ({"allowed_media_domains": [""]}, "allowed_media_domains")]:
        with pytest.raises(ConfigError) as info:
            EngineConfig(**options)
        assert info.value.field == field, options
    assert EngineConfig(limit_mm_per_prompt={"image": {"count": 3}}).limit_mm_per_prompt == {"image": {"count": 3}}
