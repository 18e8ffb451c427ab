"""Seeded JSON schemas for the structured-output acceptance (issue 16): objects, arrays, enums, nested
objects and $refs, numbers with bounds, string patterns, required and optional fields, bounded sizes.

`schema(seed)` draws one from a fixed recipe, so the same seed is the same schema everywhere. Every
string and array is bounded, so that a whole document fits in 256 tokens of the default model.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = ["name", "city", "title", "color", "status", "kind", "label", "owner", "score", "count", "level",
         "price", "rating", "active", "tags", "steps", "items", "code", "unit", "zone"]


def _leaf(rng: random.Random, depth: int, defs: dict[str, Any]) -> dict[str, Any]:
    choice = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "pattern", "object", "ref"])
    if choice == "string":
        return {"type": "string", "minLength": rng.randint(1, 3), "maxLength": rng.randint(5, 16)}
    if choice == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 200)}
    if choice == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if choice == "boolean":
        return {"type": "boolean"}
    if choice == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "open", "closed", "none"], 3)}
    if choice == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[A-Z]{2}[0-9]{3}$", "^[a-z]+-[0-9]{1,3}$",
                                                         "^(yes|no)$"])}
    if choice == "array":
        item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9},
                           {"type": "string", "maxLength": 8},
                           {"enum": ["a", "b", "c"]}])
        return {"type": "array", "items": item, "minItems": rng.randint(0, 1), "maxItems": rng.randint(2, 4)}
    if choice == "object" and depth < 2:
        return _object(rng, depth + 1, defs, num_fields=rng.randint(1, 3))
    if choice == "ref" and depth < 2:
        name = f"def{len(defs)}"
        defs[name] = {}  # the name is taken before the object is drawn: a ref inside it gets a name of its own
        defs[name] = _object(rng, depth + 1, defs, num_fields=rng.randint(1, 2))
        return {"$ref": f"#/$defs/{name}"}
    return {"type": "string", "maxLength": 10}


def _object(rng: random.Random, depth: int, defs: dict[str, Any], *, num_fields: int) -> dict[str, Any]:
    names = rng.sample(WORDS, num_fields)
    properties = {name: _leaf(rng, depth, defs) for name in names}
    required = [name for name in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def schema(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    defs: dict[str, Any] = {}
    if rng.random() < 0.15:  # a top-level array of small objects
        root: dict[str, Any] = {"type": "array", "items": _object(rng, 1, defs, num_fields=2), "minItems": 1,
                                "maxItems": 2}
    else:
        root = _object(rng, 0, defs, num_fields=rng.randint(2, 5))
    if defs:
        root["$defs"] = defs
    return root


SCHEMAS = [schema(seed) for seed in range(50)]
