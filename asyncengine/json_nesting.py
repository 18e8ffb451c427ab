"""Following the nesting of JSON text without decoding it.

JSON parsers recurse once per level of arrays and objects, so text nested deep enough exhausts their
recursion (Python's json and msgspec raise RecursionError). Text from outside (a request body, a
file a user names) is scanned here first, or after such a failure, to name or refuse the nesting.

The scan sees strings whole (escapes included, so a bracket inside a string is not one) and brackets;
an unterminated string runs to the end of the text, so every byte is looked at once (linear time,
whatever the text).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_TOKENS = re.compile(rb'"(?:[^"\\]|\\.?)*(?:"|\Z)|[\[\]{}]', re.DOTALL)


def json_tokens(data: bytes) -> Iterator[re.Match[bytes]]:
    """Each string (quotes included) and each bracket of `data`, in order."""
    return _TOKENS.finditer(data)


def nested_deeper_than(data: bytes, limit: int) -> bool:
    """Whether arrays and objects in `data` nest more than `limit` levels deep (stops at the first such level)."""
    depth = 0
    for match in json_tokens(data):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif token in (b"]", b"}"):
            depth -= 1
    return False


__all__ = ["json_tokens", "nested_deeper_than"]
