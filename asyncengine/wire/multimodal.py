"""A request's multimodal items as they cross from the frontend to the engine core and its workers.

The frontend loads each item (an image), runs the model's processor on it (off the event loop) and sends the
processor's tensors with the item's place in the prompt: the engine core reads only `identifier` and
`position` (prefix-cache keys, the encoder budget and cache); the worker reads `data` to run the vision
tower. msgspec Structs, as everything on the wire: tensors travel as raw bytes with their dtype and shape.
"""

from __future__ import annotations

import msgspec


class TensorData(msgspec.Struct, frozen=True, kw_only=True):
    """One tensor's contents: `dtype` is torch's name without the module (`float32`, `bfloat16`, `int64`),
    `data` its C-contiguous bytes in the machine's order."""

    dtype: str
    shape: list[int]
    data: bytes


class PlaceholderRange(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's name: where an item's placeholder tokens sit in the prompt (`offset`, `length` positions).
    `is_embed`, where given, marks which of those positions take one of the item's embeddings (a processor may
    put text tokens, such as row breaks, inside the range); None: every position does."""

    offset: int
    length: int
    is_embed: list[bool] | None = None


class MultiModalFeature(msgspec.Struct, frozen=True, kw_only=True):
    """One item of one request (vLLM's MultiModalFeatureSpec). `identifier` is the content hash of the item
    and the processor options it was processed with: it joins the prefix-cache keys of the blocks its
    placeholder tokens sit in and keys the encoder cache, so the same image shares work and a different one
    never does."""

    modality: str  # "image"
    identifier: str
    position: PlaceholderRange
    data: dict[str, TensorData]
