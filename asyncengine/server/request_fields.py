"""Fields a request sends that the server does not act on: ignored as vLLM ignores them, never silently.

Two kinds (docs/server.md, "Fields the server ignores"):
- unknown: a top-level field no request Struct declares. The body is decoded without it; the field's name
  goes into the response's `X-Ignored-Fields` header and a WARNING line (one per name per
  `WARN_INTERVAL_S`). With `--strict-request-fields` it is a 400 naming it instead, as msgspec says it.
  Fields inside nested objects (`stream_options`, `tools[0]`) stay strict: a typo there is a 400.
- known but without effect here: OpenAI's fields a client may send (`store`, `metadata`, `service_tier`,
  ...), declared on the Structs (so /openapi.json lists them and their types are checked) and named in
  `IGNORED_FIELDS`; one that a request sets is listed in `X-Ignored-Fields` too (no log line: they are
  documented).

Names come from the client: the header carries only names of letters, digits, `_`, `-` and `.` (at most
`MAX_HEADER_NAMES` of them, each at most 64 characters), and the log's memory of names is bounded.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from typing import Any

import msgspec

logger = logging.getLogger("asyncengine.server.fields")

HEADER = "X-Ignored-Fields"
WARN_INTERVAL_S = 60.0  # one warning per field name per minute
MAX_HEADER_NAMES = 32
_MAX_REMEMBERED = 1024  # names whose last warning time is kept (oldest forgotten first)
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

# Declared fields that have no effect here (documented in docs/server.md), by Struct name.
_OPENAI_IGNORED = ("store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "user")
IGNORED_FIELDS: dict[str, frozenset[str]] = {
    "CompletionRequest": frozenset(_OPENAI_IGNORED),
    "IOProcessRequest": frozenset((*_OPENAI_IGNORED, "return_tokens_as_token_ids")),  # it returns no logprobs
    "ChatCompletionRequest": frozenset((*_OPENAI_IGNORED, "reasoning_effort", "modalities", "verbosity", "functions",
                                        "function_call", "parallel_tool_calls", "audio", "prediction",
                                        "web_search_options")),
}

_last_warned: OrderedDict[str, float] = OrderedDict()


def decode(body: bytes, struct: type, *, strict: bool) -> tuple[Any, list[str]]:
    """`body` as `struct`, and the names of its unknown top-level fields (decoded without them). Strict, or
    a body that is not a JSON object: msgspec's error as it comes (a 400 naming the field, errors.py)."""
    try:
        return msgspec.json.decode(body, type=struct), []
    except msgspec.ValidationError as error:
        text = str(error)  # a top-level field's has no " - at `$...`" path
        if strict or not text.startswith("Object contains unknown field") or " - at `$" in text:
            raise
    known = {info.encode_name for info in msgspec.structs.fields(struct)}
    keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw])  # the values stay undecoded
    unknown = [key for key in keys if key not in known]
    return msgspec.json.decode(body, type=_lenient(struct)), unknown


_lenient_structs: dict[type, type] = {}


def _lenient(struct: type) -> type:
    """`struct` that skips unknown top-level fields (its nested Structs keep their own rule)."""
    lenient = _lenient_structs.get(struct)
    if lenient is None:
        lenient = msgspec.defstruct(struct.__name__, [], bases=(struct,), kw_only=True, forbid_unknown_fields=False,
                                    module=struct.__module__)
        _lenient_structs[struct] = lenient
    return lenient


def ignored_known(request: Any) -> list[str]:
    """The declared-but-ignored fields `request` sets (IGNORED_FIELDS), in declaration order."""
    names = IGNORED_FIELDS.get(type(request).__name__)
    if not names:
        return []
    return [info.encode_name for info in msgspec.structs.fields(request)
            if info.name in names and getattr(request, info.name) is not None
            and not (info.name == "parallel_tool_calls" and _forced_tool_choice(request))]


def _forced_tool_choice(request: Any) -> bool:
    """A tool_choice that forces calls ("required" or a named function): parallel_tool_calls false then
    asks for exactly one call (tool_choice.py), so it is honoured, not ignored."""
    choice = getattr(request, "tool_choice", None)
    return choice == "required" or isinstance(choice, dict)


def warn_unknown(names: list[str], path: str) -> None:
    """One WARNING per unknown field name per WARN_INTERVAL_S, across requests."""
    now = time.monotonic()
    for name in names:
        key = name[:64]
        last = _last_warned.get(key)
        if last is not None and now - last < WARN_INTERVAL_S:
            continue
        _last_warned[key] = now
        _last_warned.move_to_end(key)
        while len(_last_warned) > _MAX_REMEMBERED:
            _last_warned.popitem(last=False)
        logger.warning("%s: ignored the request field %r, which this server does not know (as vLLM ignores it; "
                       "--strict-request-fields makes it a 400); further requests with it are not logged for %.0f s",
                       path, key, WARN_INTERVAL_S)


def header_value(names: list[str]) -> str | None:
    """The X-Ignored-Fields value for `names`: the safe ones, comma-separated; `+N` counts those left out."""
    safe = [name for name in dict.fromkeys(names) if _NAME.match(name)]
    shown = safe[:MAX_HEADER_NAMES]
    left_out = len(dict.fromkeys(names)) - len(shown)
    if not shown and not left_out:
        return None
    return ", ".join(shown + ([f"+{left_out}"] if left_out else []))
