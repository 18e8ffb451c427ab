"""The images of a conversation: image parts found, loaded and replaced by the `{"type": "image"}` parts chat
templates render as the model's placeholder (frontend/chat_messages.py).

Parts read (docs/multimodal.md, "Inputs"): OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` (the
url a data:, file:// or http(s) address, media.py; `image_url` given as the url string itself is taken too,
as vLLM takes it) and vLLM's `{"type": "image_pil", "image_pil": <PIL.Image>}` for `LLM.chat`. vLLM's
`image_embeds` parts are refused: the contract carries pixels, not embeddings; so is a bare `{"type": "image"}`
part, which would put an image's placeholder in the prompt with no image behind it (vLLM takes no such part).

The count is checked against --limit-mm-per-prompt before anything is fetched or decoded; fetching is async
(cancelled with the request) and decoding runs in the tokenizer pool. A bad image is a RequestError naming
the part, `messages[0].content[1].image_url`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from asyncengine.errors import RequestError
from asyncengine.frontend.media import (
    MediaLimits,
    decode_data_url,
    decode_image,
    image_bytes_from_url,
    image_from_object,
)

IMAGE_PARTS = ("image_url", "image_pil")
REFUSED_PARTS = {"image_embeds": "image embeddings are not taken: send the image itself (image_url)",
                 "input_image": "send images as image_url parts (the chat completions API's form)",
                 # what a chat template renders for a loaded image: from a client, a placeholder without an image
                 "image": "such a part carries no image: send the image as an image_url part"}
# OpenAI's image_url.detail: checked, and without effect (as in vLLM): the model's processor sets the resolution.
IMAGE_DETAILS = ("auto", "low", "high")
RunInPool = Callable[..., Awaitable[Any]]


def image_parts(messages: list[dict[str, Any]]) -> list[tuple[int, int, dict[str, Any]]]:
    """(message index, part index, part) of every image part, in order."""
    found = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part_index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in REFUSED_PARTS:
                where = f"messages[{index}].content[{part_index}]"
                raise RequestError(f"{where}: {kind} parts are not supported: {REFUSED_PARTS[kind]}",
                                   field=f"{where}.type", code="unsupported_parameter")
            if kind in IMAGE_PARTS:
                found.append((index, part_index, part))
    return found


async def load_chat_images(messages: list[dict[str, Any]], limits: MediaLimits, max_images: int,
                           run_in_pool: RunInPool) -> tuple[list[dict[str, Any]], list[Any]]:
    """`messages` with each image part made `{"type": "image"}` (new dicts), and the images in order."""
    parts = image_parts(messages)
    if not parts:
        return messages, []
    if len(parts) > max_images:
        index, part_index, _ = parts[max_images]
        raise RequestError(f"the conversation has {len(parts)} images, over the limit of {max_images} per prompt "
                           "(--limit-mm-per-prompt '{\"image\": N}')", field=f"messages[{index}].content[{part_index}]")
    images = []
    for index, part_index, part in parts:
        kind = part["type"]
        where = f"messages[{index}].content[{part_index}].{kind}"
        value = part.get(kind)
        if kind == "image_pil":
            images.append(await run_in_pool(image_from_object, value, limits, where))
            continue
        url = value.get("url") if isinstance(value, dict) else value
        if isinstance(value, dict) and value.get("detail", "auto") not in IMAGE_DETAILS:
            raise RequestError(f"{where}.detail must be one of {', '.join(IMAGE_DETAILS)}, got {value['detail']!r}",
                               field=f"{where}.detail")
        if not isinstance(url, str):
            raise RequestError(f"{where} must be {{\"url\": \"data:image/png;base64,...\"}}", field=where)
        if url[:5].lower() == "data:":
            images.append(await run_in_pool(decode_data_url, url, limits, where))
            continue
        data = await image_bytes_from_url(url, limits, where)
        images.append(await run_in_pool(decode_image, data, limits, where))
    return image_placeholders(messages), images


def image_placeholders(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each image part made `{"type": "image"}` (new dicts where one changes; nothing loaded)."""
    return [{**message, "content": [{"type": "image"} if isinstance(part, dict) and part.get("type") in IMAGE_PARTS
                                    else part for part in message["content"]]}
            if isinstance(message, dict) and isinstance(message.get("content"), list) else message
            for message in messages]


__all__ = ["IMAGE_PARTS", "image_parts", "image_placeholders", "load_chat_images"]
