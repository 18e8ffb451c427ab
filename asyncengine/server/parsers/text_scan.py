"""Reading a model's text while it grows: where a JSON value or a Python literal ends, and how much of a
text could still be the start of a marker. The tool parsers read their formats with these.

Every function here answers for a prefix of the final text: "not yet" (None) while the text may still
go on to complete what it started, and raises MalformedText once no continuation could make it valid,
so a parser can tell "wait" from "this is not a tool call".
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any


class MalformedText(ValueError):
    """The text cannot be what the format expects, however it goes on."""


def partial_marker_length(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of one of `markers` (0 if none).

    Streaming holds these back: sending "[TOOL" as content and then finding "_CALLS]" would leak a marker.
    Only the text's last characters are read.
    """
    longest = 0
    for marker in markers:
        position = text.find(marker[0], max(0, len(text) - len(marker) + 1))
        while position != -1:
            if marker.startswith(text[position:]):
                longest = max(longest, len(text) - position)
                break
            position = text.find(marker[0], position + 1)
    return longest


def find_growing(text: str, marker: str, start: int, memo: dict[Any, Any] | None) -> int:
    """`text.find(marker, start)`; with a stream's `memo` (its text only grows), resuming where an earlier
    search stopped, so each part of a long text is searched once, not again on every delta."""
    if memo is None:
        return text.find(marker, start)
    key = ("find", marker, start)
    index = text.find(marker, memo.get(key, start))
    memo[key] = index if index != -1 else max(start, len(text) - len(marker) + 1)
    return index


def find_marker(text: str, start: int, markers: tuple[str, ...],
                memo: dict[Any, Any] | None = None) -> tuple[int, str] | None:
    """The first of `markers` in `text` from `start`: (its index, which marker); None if none occurs."""
    found: tuple[int, str] | None = None
    for marker in markers:
        index = find_growing(text, marker, start, memo)
        if index != -1 and (found is None or index < found[0]):
            found = (index, marker)
    return found


def skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def is_prefix_of_any(text: str, words: tuple[str, ...]) -> bool:
    return any(word.startswith(text) for word in words)


# -- JSON ----------------------------------------------------------------------------------------------

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_SCALAR = re.compile(r"[-+\w.]+")
# What may stand between a container's strings and brackets: numbers, literals, separators, space.
_JSON_GAP = re.compile(r"(?:[\s\d.eE+\-:,]|true|false|null)*")
_JSON_WORDS = ("true", "false", "null")
_CLOSING = {"}": "{", "]": "["}


def json_value_end(text: str, start: int, memo: dict[Any, Any] | None = None) -> int | None:
    """Where the JSON value that begins at `start` ends (exclusive); None while the text may still
    complete it. Only the value's extent is checked here: json.loads judges its content.

    `memo` (a stream's, for a text that only grows) keeps how far each value was read, so each new
    piece of a long value is read once, not the whole value again on every delta."""
    if start >= len(text):
        return None
    if text[start] in '{["':
        extent = memo.setdefault(("json", start), _JsonExtent(start)) if memo is not None else _JsonExtent(start)
        return extent.advance(text)
    scalar = _JSON_SCALAR.match(text, start)
    if scalar is None:
        raise MalformedText(f"no JSON value at {start}")
    return scalar.end() if scalar.end() < len(text) else None  # "12" may still become "123"


_JSON_STRUCTURE = re.compile(r'["{}\[\]]')
_STRING_STOP = re.compile(r'["\\]')


class _JsonExtent:
    """Reads a JSON container or string from where it begins, resuming where it stopped."""

    def __init__(self, start: int) -> None:
        self.position = start  # read up to here
        self.gap_start = start  # where the text between tokens began
        self.stack: list[str] = []
        self.in_string = False
        self.end: int | None = None

    def advance(self, text: str) -> int | None:
        while self.end is None:
            if self.in_string:
                self.position, closed = read_string(text, self.position, _STRING_STOP)
                if not closed:
                    return None
                self.in_string = False
                self.gap_start = self.position
                if not self.stack:
                    self.end = self.position  # the value was a string
                continue
            token = _JSON_STRUCTURE.search(text, self.position)
            if token is None:
                _check_gap(text, self.gap_start, len(text), at_end=True)
                self.position = len(text)
                return None
            _check_gap(text, self.gap_start, token.start(), at_end=False)
            self.position = self.gap_start = token.end()
            value = token.group()
            if value == '"':
                self.in_string = True
            elif value in "{[":
                self.stack.append(value)
            elif not self.stack or self.stack.pop() != _CLOSING[value]:
                raise MalformedText(f"unbalanced {value!r} at {token.start()}")
            elif not self.stack:
                self.end = token.end()
        return self.end


def read_string(text: str, position: int, stops: re.Pattern[str]) -> tuple[int, bool]:
    """Read inside a string from `position` to its closing quote (`stops` finds it or a backslash): where
    the reading stopped, and whether the string closed there (else the text ended inside it)."""
    while (stop := stops.search(text, position)) is not None:
        if stop.group() != "\\":
            return stop.end(), True
        if stop.end() >= len(text):
            return stop.start(), False  # the escaped character is still to come
        position = stop.end() + 1
    return len(text), False


def _check_gap(text: str, start: int, end: int, *, at_end: bool) -> None:
    """Text between a JSON container's tokens must be numbers, literals, separators or space (at the end
    of the text, the start of a literal too): anything else (a fence, a marker, a bare word) breaks it
    as soon as it is written, before a stream sends it as arguments."""
    valid = _JSON_GAP.match(text, start, end).end()  # type: ignore[union-attr]  # matches "" at worst
    if valid < end and not (at_end and is_prefix_of_any(text[valid:end], _JSON_WORDS)):
        raise MalformedText(f"{text[valid:end][:20]!r} cannot be part of JSON")


def object_has_begun(text: str, start: int) -> bool:
    """Whether the text at `start` opens a JSON object and has begun its first member (or closed it):
    the point from which a stream sends a call whose arguments it is."""
    if not text.startswith("{", start):
        return False
    position = skip_space(text, start + 1)
    return position < len(text) and text[position] in '"}'


def parse_json_object_text(raw: str) -> str:
    """Arguments written as a JSON object, checked; a JSON string holding one is unwrapped. The object's
    text as the model wrote it is what OpenAI's `arguments` carries (clients json.loads it)."""
    try:
        value = json.loads(raw)
        if isinstance(value, str):  # some models write the arguments as a string of JSON
            raw, value = value, json.loads(value)
    except ValueError as error:
        raise MalformedText(f"arguments are not JSON: {error}") from None
    if not isinstance(value, dict):
        raise MalformedText(f"arguments are a JSON {type(value).__name__}, not an object")
    return raw


class JsonCall:
    """What a `{"name": ..., "arguments": {...}}` object says so far (the key may be "parameters")."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments_start: int | None = None  # where the arguments value begins in the text
        self.arguments_end: int | None = None  # where it ends, once it has
        self.end: int | None = None  # where the object ends, once it has


ARGUMENT_KEYS = ("arguments", "parameters")


def scan_json_call(text: str, start: int, memo: dict[Any, Any] | None = None) -> JsonCall:
    """Read the call object that begins at `start` (a "{") as far as the text goes. Keys other than the
    name and the arguments are skipped. MalformedText when it is not an object of string keys. `memo`:
    as json_value_end's."""
    call = JsonCall()
    if not text.startswith("{", start):
        raise MalformedText(f"a call object must begin with '{{' at {start}")
    position = start + 1
    while True:
        position = skip_space(text, position)
        if position >= len(text):
            return call
        if text[position] == "}":
            call.end = position + 1
            return call
        key_match = _JSON_STRING.match(text, position)
        if key_match is None:
            if text[position] == '"':
                return call  # the key is still being written
            raise MalformedText(f"expected a key at {position}")
        key = _json_string(key_match.group())
        position = skip_space(text, key_match.end())
        if position >= len(text):
            return call
        if text[position] != ":":
            raise MalformedText(f"expected ':' after key {key!r}")
        position = skip_space(text, position + 1)
        if position >= len(text):
            return call
        if key in ARGUMENT_KEYS and call.arguments_start is None:
            call.arguments_start = position
        end = json_value_end(text, position, memo)
        if end is None:
            return call
        if key == "name":
            name = _json_string(text[position:end]) if text[position] == '"' else None
            if not isinstance(name, str) or not name:
                raise MalformedText("a call's name must be a non-empty string")
            call.name = name
        if call.arguments_start == position:
            call.arguments_end = end
        position = skip_space(text, end)
        if position >= len(text):
            return call
        if text[position] == ",":
            position += 1
        elif text[position] != "}":
            raise MalformedText(f"expected ',' or '}}' at {position}")


def _json_string(source: str) -> str:
    try:
        return json.loads(source)
    except ValueError as error:  # a bad escape or a raw control character
        raise MalformedText(f"{source[:40]!r} is not a JSON string: {error}") from None


# -- Python literals -----------------------------------------------------------------------------------

# What decides where a Python literal ends: quotes (triple first), brackets, and the "," that ends an
# argument at depth 0.
_PYTHON_STRUCTURE = re.compile(r"'''|\"\"\"|['\"()\[\]{},]")
_PYTHON_CLOSING = {")": "(", "]": "[", "}": "{"}


def python_value_end(text: str, start: int, memo: dict[Any, Any] | None = None) -> int | None:
    """Where the Python literal that begins at `start` ends: the index of the "," or ")" that follows it
    at depth 0; None while the text may still complete it. `memo`: as json_value_end's."""
    extent = memo.setdefault(("python", start), _PythonExtent(start)) if memo is not None else _PythonExtent(start)
    return extent.advance(text)


class _PythonExtent:
    """Reads a Python literal from where it begins, resuming where it stopped."""

    def __init__(self, start: int) -> None:
        self.position = start
        self.stack: list[str] = []
        self.quote: re.Pattern[str] | None = None  # inside a string: what ends it (or escapes in it)
        self.end: int | None = None

    def advance(self, text: str) -> int | None:
        while self.end is None:
            if self.quote is not None:
                position, closed = read_string(text, self.position, self.quote)
                if not closed:
                    # the text may end in the first quotes of a closing triple quote: read them again
                    self.position = max(self.position, min(position, len(text) - 2))
                    return None
                self.quote, self.position = None, position
                continue
            token = _PYTHON_STRUCTURE.search(text, self.position)
            if token is None:
                self.position = len(text)
                return None
            value = token.group()
            if value in ("'", '"') and token.end() + 2 > len(text):
                self.position = token.start()  # a quote near the end may begin a triple quote: wait
                return None
            self.position = token.end()
            if value[0] in "'\"":
                self.quote = re.compile(r"\\|" + re.escape(value))
            elif value in "([{":
                self.stack.append(value)
            elif value in ")]}":
                if not self.stack and value == ")":
                    self.end = token.start()
                elif not self.stack or self.stack.pop() != _PYTHON_CLOSING[value]:
                    raise MalformedText(f"unbalanced {value!r} at {token.start()}")
            elif not self.stack:  # a "," at depth 0
                self.end = token.start()
        return self.end


def python_literal_as_json(source: str) -> Any:
    """The value of a Python literal (numbers, strings, True/False/None, lists, tuples, dicts) in JSON's
    terms; MalformedText for anything else (a name, a call, a set, bytes)."""
    try:
        value = ast.literal_eval(source.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError) as error:
        raise MalformedText(f"{source.strip()!r} is not a Python literal: {error}") from None
    return _jsonable(value, source)


def _jsonable(value: Any, source: str) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise MalformedText(f"{source.strip()!r} is not a number JSON can carry")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(item, source) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _jsonable(item, source) for key, item in value.items()}
    raise MalformedText(f"{source.strip()!r} has a value JSON cannot carry ({type(value).__name__})")
