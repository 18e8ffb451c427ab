"""ItemsProcessor: an IO processor that asks the model the same question about each item of a list.

`io_processor()` is the entry point (group `asyncengine.io_processor_plugins`): it returns the class's
path, and the server builds one instance when `--io-processor-plugin ae_example_items` chooses it.
A request to POST /v1/io_process sends

    {"data": {"items": ["the sky", "grass"], "template": "The color of {item} is"}, "max_tokens": 8}

`pre_process` (a plain method: the server runs it in a worker thread) checks `data` and builds one
prompt per item from the template; `post_process` (async: awaited on the server's event loop) gives
one result per item, in order:

    {"results": [{"prompt": "The color of the sky is", "text": " blue ...", "token_ids": [...],
                  "finish_reason": "length"}, ...], "count": 2}

With AE_PLUGIN_RECORD naming a file, each of the two methods appends one JSON line there per process
the first time it runs, naming the pid and the process role. It imports only asyncengine.plugins_api.
"""

from __future__ import annotations

import json
import os
from typing import Any

from asyncengine.plugins_api import IOProcessor, RequestError, current_process_role

__all__ = ["DEFAULT_TEMPLATE", "ItemsProcessor", "io_processor"]

DEFAULT_TEMPLATE = "Here is one sentence about {item}:"
MAX_ITEMS = 64  # one engine request per item: a bound keeps one HTTP request from flooding the engine
_recorded: set[str] = set()


def io_processor() -> str:
    """The entry point: the path of the IOProcessor subclass."""
    return "ae_io_processor_example:ItemsProcessor"


def _record_once(what: str) -> None:
    """One line per `what` and process, only when AE_PLUGIN_RECORD is set."""
    path = os.environ.get("AE_PLUGIN_RECORD")
    if not path or what in _recorded:
        return
    _recorded.add(what)
    line = {"what": what, "pid": os.getpid(), "role": current_process_role()}
    with open(path, "a", encoding="utf-8") as record:
        record.write(json.dumps(line) + "\n")


def parse_data(data: Any) -> tuple[list[str], str]:
    """The request's items and template; RequestError (HTTP 400, param `data....`) when malformed."""
    if not isinstance(data, dict):
        raise RequestError(f"data must be an object {{'items': [...], 'template': ...}}, got {type(data).__name__}",
                           field="data")
    unknown = sorted(set(data) - {"items", "template"})
    if unknown:
        raise RequestError(f"data has unknown key(s) {', '.join(unknown)}: it takes 'items' and 'template'",
                           field=f"data.{unknown[0]}")
    items = data.get("items")
    if not isinstance(items, list) or not items or not all(isinstance(item, str) and item for item in items):
        raise RequestError("data.items must be a non-empty list of non-empty strings", field="data.items")
    if len(items) > MAX_ITEMS:
        raise RequestError(f"data.items has {len(items)} items; at most {MAX_ITEMS}", field="data.items")
    template = data.get("template", DEFAULT_TEMPLATE)
    if not isinstance(template, str) or "{item}" not in template:
        raise RequestError("data.template must be a string containing '{item}'", field="data.template")
    return items, template


class ItemsProcessor(IOProcessor):
    """One prompt per item; one result per prompt, in the items' order (post_process sees only the
    outputs, so each result names its prompt, which the engine's output carries)."""

    def pre_process(self, request: Any) -> list[str]:
        _record_once("io processor pre_process")
        items, template = parse_data(request.data)
        # str.replace, not str.format: an item holding braces must not be read as a format field.
        return [template.replace("{item}", item) for item in items]

    async def post_process(self, outputs: list[Any]) -> dict[str, Any]:
        _record_once("io processor post_process")
        results = []
        for output in outputs:
            first = output.outputs[0]
            results.append({"prompt": output.prompt, "text": first.text, "token_ids": list(first.token_ids),
                            "finish_reason": first.finish_reason})
        return {"results": results, "count": len(results)}
