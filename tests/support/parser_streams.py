"""Driving a parser's streaming method as the chat route does: a text cut into pieces, fed delta by delta."""

from __future__ import annotations

import itertools
from typing import Any


def sized_chunks(text: str, sizes: list[int]) -> list[str]:
    """`text` cut into pieces of the given sizes, repeated until it is used up."""
    out, position = [], 0
    for size in itertools.cycle(sizes):
        if position >= len(text):
            return out
        out.append(text[position:position + size])
        position += size


def feed(method: Any, pieces: list[str], request: Any) -> list[Any]:
    """Call a streaming method (`extract_tool_calls_streaming` or `extract_reasoning_streaming`) once per
    piece, with the text so far; the deltas it returned (None aside)."""
    previous, deltas = "", []
    for piece in pieces:
        current = previous + piece
        delta = method(previous, current, piece, request)
        if delta is not None:
            deltas.append(delta)
        previous = current
    return deltas
