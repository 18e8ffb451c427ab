"""Images from where requests bring them: checked, decoded and bounded, or a RequestError naming the part.

Sources (docs/multimodal.md, "Inputs"): `data:` URLs (base64), `file://` paths under
`--allowed-local-media-path` (symlinks resolved; a path that leaves the folder is refused), `http(s)`
URLs whose host is in `--allowed-media-domains` (fetched here, bounded in bytes and time, no redirects),
and the Python objects `LLM.generate` takes (a PIL image, an HxWxC or CxHxW array or tensor, encoded bytes).

Every image is bounded twice before it is decoded: its encoded bytes (`max_image_bytes`) and the
pixels its header announces (`max_image_pixels`), which is the decompression-bomb guard (a few KB of
PNG can announce gigapixels). Decoding runs where the caller runs it: in the frontend's tokenizer pool,
never on the event loop. The fetch is async (anyio, h11) and is cancelled with its request.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import struct
import urllib.parse
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc

from asyncengine.errors import RequestError

# The formats decoded (pillow's names); any other is refused before a decoder runs on it.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_FETCH_TIMEOUT = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT


@dataclass(frozen=True)
class MediaLimits:
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    allowed_local_media_path: str = ""
    allowed_media_domains: tuple[str, ...] = ()

    @classmethod
    def of(cls, config: Any) -> MediaLimits:
        return cls(max_image_bytes=config.max_image_bytes, max_image_pixels=config.max_image_pixels,
                   fetch_timeout=config.media_fetch_timeout,
                   allowed_local_media_path=config.allowed_local_media_path or "",
                   allowed_media_domains=tuple(domain.lower() for domain in config.allowed_media_domains or ()))


# -- URLs --------------------------------------------------------------------------------------------------


async def image_bytes_from_url(url: Any, limits: MediaLimits, where: str) -> bytes:
    """The encoded image an `image_url` names: a data URL, a permitted file or a permitted web address."""
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where}.url must be a non-empty string", field=f"{where}.url")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return parse_data_url(url, limits, where)
    if scheme == "file":
        return await anyio.to_thread.run_sync(read_local_file, url, limits, where)
    if scheme in ("http", "https"):
        return await fetch_url(url, limits, where)
    raise RequestError(f"{where}: an image URL is data:, file:// or http(s)://, got {_short(url)}", field=where)


def parse_data_url(url: str, limits: MediaLimits, where: str) -> bytes:
    """`data:image/png;base64,....`: the decoded bytes (the media type is not trusted: the decoder checks)."""
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().startswith("data:"):
        raise RequestError(f"{where}: a data URL is data:<media type>;base64,<data>", field=where)
    media_type, *params = header[5:].split(";")
    if "base64" not in (param.strip().lower() for param in params):
        raise RequestError(f"{where}: only base64 data URLs are read (data:{media_type or 'image/png'};base64,...)",
                           field=where)
    if media_type and not media_type.lower().startswith("image/"):
        raise RequestError(f"{where}: the data URL holds {media_type!r}, not an image", field=where)
    # Base64 is 4/3 of the bytes: refuse an oversized payload before decoding it.
    if len(payload) > limits.max_image_bytes * 4 // 3 + 4:
        raise _too_large(where, len(payload) * 3 // 4, limits)
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"{where}: the data URL's base64 does not decode: {exc}", field=where) from exc


def decode_data_url(url: str, limits: MediaLimits, where: str) -> Any:
    """A data URL's image, decoded: base64 and pixels both in the caller's thread (a pool's: 20 MB of base64
    take tens of milliseconds to decode, too long for the event loop)."""
    return decode_image(parse_data_url(url, limits, where), limits, where)


def read_local_file(url: str, limits: MediaLimits, where: str) -> bytes:
    """`file:///path`, when the path (symlinks resolved) lies under --allowed-local-media-path."""
    if not limits.allowed_local_media_path:
        raise RequestError(f"{where}: file:// URLs are refused: the server was not started with "
                           "--allowed-local-media-path DIR", field=where)
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise RequestError(f"{where}: a file:// URL names no host (file:///path), got host {parts.netloc!r}",
                           field=where)
    base = os.path.realpath(limits.allowed_local_media_path)
    path = os.path.realpath(urllib.parse.unquote(parts.path))
    if os.path.commonpath([base, path]) != base:
        raise RequestError(f"{where}: {_short(url)} is outside the allowed local media folder "
                           "(--allowed-local-media-path)", field=where)
    try:
        with open(path, "rb") as file:
            data = file.read(limits.max_image_bytes + 1)
    except OSError as exc:
        raise RequestError(f"{where}: cannot read {_short(url)}: {exc.strerror or exc}", field=where) from exc
    if len(data) > limits.max_image_bytes:
        raise _too_large(where, len(data), limits)
    return data


def domain_allowed(host: str, limits: MediaLimits) -> bool:
    host = host.lower().rstrip(".")
    return "*" in limits.allowed_media_domains or host in limits.allowed_media_domains


async def fetch_url(url: str, limits: MediaLimits, where: str) -> bytes:
    """GET `url` (HTTP/1.1 through h11 over anyio: cancellable, never blocking the loop), at most
    max_image_bytes within fetch_timeout seconds; redirects are not followed."""
    import h11

    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if not host or not domain_allowed(host, limits):
        allowed = ", ".join(limits.allowed_media_domains) or "none"
        raise RequestError(f"{where}: fetching images from {host or _short(url)!r} is not allowed (allowed media "
                           f"domains: {allowed}; start the server with --allowed-media-domains to permit a domain, "
                           "or send the image as a data: URL)", field=where)
    https = parts.scheme.lower() == "https"
    try:
        port = parts.port or (443 if https else 80)
    except ValueError as exc:
        raise RequestError(f"{where}: {_short(url)} has a bad port", field=where) from exc
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    connection = h11.Connection(our_role=h11.CLIENT, max_incomplete_event_size=64 * 1024)
    body = bytearray()
    try:
        with anyio.fail_after(limits.fetch_timeout):
            stream: anyio.abc.ByteStream = await (anyio.connect_tcp(host, port, tls=True, tls_hostname=host) if https
                                                  else anyio.connect_tcp(host, port))
            async with stream:
                request = h11.Request(method="GET", target=target, headers=[
                    ("Host", parts.netloc.rsplit("@", 1)[-1]), ("User-Agent", "asyncengine"), ("Accept", "image/*"),
                    ("Connection", "close")])
                await stream.send(connection.send(request) + connection.send(h11.EndOfMessage()))
                while True:
                    event = connection.next_event()
                    if event is h11.NEED_DATA:
                        try:
                            chunk = await stream.receive(65536)
                        except (anyio.EndOfStream, anyio.BrokenResourceError):
                            chunk = b""
                        connection.receive_data(chunk)
                        continue
                    if isinstance(event, h11.Response):
                        _check_response(event, url, limits, where)
                    elif isinstance(event, h11.Data):
                        body += event.data
                        if len(body) > limits.max_image_bytes:
                            raise _too_large(where, len(body), limits)
                    elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                        break
    except TimeoutError as exc:
        raise RequestError(f"{where}: fetching {_short(url)} took longer than {limits.fetch_timeout:g} s",
                           field=where) from exc
    except (OSError, anyio.BrokenResourceError, h11.ProtocolError) as exc:
        raise RequestError(f"{where}: could not fetch {_short(url)}: {exc}", field=where) from exc
    return bytes(body)


def _check_response(response: Any, url: str, limits: MediaLimits, where: str) -> None:
    if response.status_code != 200:
        hint = " (redirects are not followed: send the final address)" if 300 <= response.status_code < 400 else ""
        raise RequestError(f"{where}: fetching {_short(url)} answered HTTP {response.status_code}{hint}", field=where)
    for name, value in response.headers:
        if name == b"content-length" and value.isdigit() and int(value) > limits.max_image_bytes:
            raise _too_large(where, int(value), limits)


# -- decoding and checking ---------------------------------------------------------------------------------


def decode_image(data: bytes, limits: MediaLimits, where: str) -> Any:
    """Encoded bytes -> an RGB PIL image, or a RequestError naming `where`. For a pool thread."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_image_bytes:
        raise _too_large(where, len(data), limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
            _check_pixels(image.size, limits, where)  # from the header, before any pixel is decoded
            image.load()
    except RequestError:
        raise
    except UnidentifiedImageError as exc:
        raise RequestError(f"{where}: not an image this server reads ({', '.join(IMAGE_FORMATS)})",
                           field=where) from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # pillow's own guard, from the header: over twice its limit before ours could read the size, or over its
        # limit where ours is higher
        pillows = Image.MAX_IMAGE_PIXELS
        limit = (f"pillow's decompression-bomb limit of {pillows}" if pillows and pillows < limits.max_image_pixels
                 else f"the limit of {limits.max_image_pixels} (--max-image-pixels)")
        raise RequestError(f"{where}: the image has too many pixels, over {limit}: send a smaller image ({exc})",
                           field=where) from exc
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error) as exc:
        raise RequestError(f"{where}: the image is damaged or truncated: {exc}", field=where) from exc
    return to_rgb(image)


def image_from_object(item: Any, limits: MediaLimits, where: str) -> Any:
    """What `multi_modal_data["image"]` may hold, as an RGB PIL image: a PIL image, an image array or tensor
    (HxWxC or CxHxW, uint8, or floats in [0, 1]) or encoded bytes."""
    from PIL import Image

    if isinstance(item, (bytes, bytearray)):
        return decode_image(bytes(item), limits, where)
    if isinstance(item, Image.Image):
        _check_pixels(item.size, limits, where)
        try:
            item.load()
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise RequestError(f"{where}: the image is damaged or truncated: {exc}", field=where) from exc
        return to_rgb(item)
    array = _as_array(item)
    if array is None:
        raise RequestError(f"{where}: an image is a PIL.Image, an array or tensor of pixels, or encoded bytes; got "
                           f"{type(item).__name__}", field=where)
    return _array_image(array, limits, where)


def _as_array(item: Any) -> Any | None:
    import numpy as np

    if isinstance(item, np.ndarray):
        return item
    if type(item).__module__.startswith("torch") and hasattr(item, "detach"):
        return item.detach().cpu().numpy()
    return None


def _array_image(array: Any, limits: MediaLimits, where: str) -> Any:
    import numpy as np
    from PIL import Image

    if array.ndim == 2 and array.dtype.kind == "f" and array.shape[1] > 4:
        raise RequestError(f"{where}: a 2-D float tensor looks like image embeddings, which are not taken here: "
                           "send the image's pixels", field=where)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3:
        raise RequestError(f"{where}: an image array has 3 dimensions (HxWxC or CxHxW), got shape "
                           f"{tuple(array.shape)}", field=where)
    if array.shape[-1] not in (1, 3, 4) and array.shape[0] in (1, 3, 4):
        array = np.moveaxis(array, 0, -1)
    if array.shape[-1] not in (1, 3, 4):
        raise RequestError(f"{where}: an image array has 1, 3 or 4 channels, got shape {tuple(array.shape)}",
                           field=where)
    _check_pixels((array.shape[1], array.shape[0]), limits, where)
    if array.dtype.kind == "f":
        if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
            raise RequestError(f"{where}: a float image array holds values in [0, 1]", field=where)
        array = np.rint(array * 255)
    elif array.dtype.kind not in "ui" or array.min() < 0 or array.max() > 255:
        raise RequestError(f"{where}: an integer image array holds values 0..255", field=where)
    array = np.ascontiguousarray(array.astype(np.uint8))
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[array.shape[-1]]
    return to_rgb(Image.fromarray(array[:, :, 0] if mode == "L" else array, mode=mode))


def _check_pixels(size: tuple[int, int], limits: MediaLimits, where: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise RequestError(f"{where}: the image is empty ({width}x{height})", field=where)
    if width * height > limits.max_image_pixels:
        raise RequestError(f"{where}: the image is {width}x{height} = {width * height} pixels, over the limit of "
                           f"{limits.max_image_pixels} (--max-image-pixels): send a smaller image", field=where)


def to_rgb(image: Any) -> Any:
    """RGB, as vision models take it; transparency over white, as vLLM does."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


def image_identifier(image: Any, options: Mapping[str, Any], processor: str) -> str:
    """sha256 hex over the decoded pixels, mode and size, and the processing options: the same image
    processed the same way gets the same identifier, whatever bytes or object it came as."""
    import json

    digest = hashlib.sha256()
    digest.update(f"{processor}|{image.mode}|{image.size[0]}x{image.size[1]}|".encode())
    digest.update(json.dumps(dict(options), sort_keys=True, default=repr).encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _too_large(where: str, size: int, limits: MediaLimits) -> RequestError:
    return RequestError(f"{where}: the image is {size} bytes or more, over the limit of {limits.max_image_bytes} "
                        "(--max-image-bytes)", field=where)


def _short(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."
