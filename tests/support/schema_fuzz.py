"""Hypothesis strategies for request bodies, built from the JSON schemas of the server's OpenAPI document.

A body is mostly valid, so that it gets past decoding and reaches what checks values further in (the
sampling parameters, the engine, the chat template), with a few fields drawn from their schema at
their extremes: integers 0, negative, 2^31, 2^63, 2^64 and beyond; floats tiny, huge, NaN and
infinity; unicode, empty and megabyte strings; empty and huge lists; values of the wrong type; deep
nesting. Some bodies are broken as a whole: a required field missing, an unknown field, not an
object, not JSON.

`Raw` values are JSON text put into the body as it is encoded (`encode_body`): what Python's json
module cannot write (10,000 levels of nesting, a number past a float's range) or would take long to
draw (a list of 100,000 token ids).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

EXTREME_INTS = [0, -1, 1, 2, 2**31 - 1, 2**31, -(2**31) - 1, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1,
                2**64 - 1, 2**64, -(2**64), 10**30]
# Where a value stops fitting the engine's integer types (int32 token ids, int64 seeds and counts, uint64).
DANGEROUS_INTS = [0, -1, -2, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64 - 1, 2**64, 10**30,
                  -(10**30)]
EXTREME_FLOATS = [0.0, -0.0, 5e-324, 1e-300, -1.0, -1e-9, 0.5, 1.0, 1.0000001, 2.0, 100.0, 1e308, -1e308,
                  float("inf"), float("-inf"), float("nan")]
EXTREME_STRINGS = ["", " ", "\x00", "\ud800", "\U0001f600" * 50, "é" * 3000, "<|im_end|>", "{{ raise }}",
                   "{% for x in range(10**9) %}{% endfor %}", "x" * 100_000]


@dataclass(frozen=True)
class Raw:
    """JSON text to put in a body as it is."""

    text: str
    name: str  # what the repr of a case shows instead of the text

    def __repr__(self) -> str:
        return f"Raw({self.name})"


RAW_VALUES = [
    Raw("[" * 10_000 + "]" * 10_000, "list nested 10,000 deep"),
    Raw('{"a":' * 10_000 + "1" + "}" * 10_000, "object nested 10,000 deep"),
    Raw("[" * 100 + "1" + "]" * 100, "list nested 100 deep"),
    Raw("[" + ",".join(str(5 + i % 200) for i in range(100_000)) + "]", "100,000 token ids"),
    Raw("[" + ",".join('"a"' for _ in range(20_000)) + "]", "20,000 strings"),
    Raw("1e400", "1e400"),
    Raw("-1e400", "-1e400"),
    Raw("123456789012345678901234567890123456789", "a 39-digit integer"),
    Raw("NaN", "NaN"),
    Raw('"\\ud800"', "a lone surrogate"),
]

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                         st.text(max_size=10))
# Any JSON value, of any type: what a field of the wrong type gets.
ANY_JSON = st.recursive(JSON_SCALARS, lambda children: st.one_of(st.lists(children, max_size=3),
                                                                 st.dictionaries(st.text(max_size=5), children,
                                                                                 max_size=3)),
                        max_leaves=6)
WRONG = st.one_of(ANY_JSON, st.sampled_from(RAW_VALUES), st.sampled_from(EXTREME_INTS),
                  st.sampled_from(EXTREME_FLOATS), st.sampled_from(EXTREME_STRINGS))


class SchemaStrategies:
    """Strategies for the values of the schemas in `components` (an OpenAPI document's components.schemas).

    `hints` give the strategy of a property by name where its schema says too little (a field typed
    `Any`) or where its valid values are few (a message's `role`); `small` bounds the valid integers
    drawn, so that a valid request stays cheap to serve (max_tokens, n)."""

    def __init__(self, components: dict[str, Any], hints: dict[str, st.SearchStrategy] | None = None,
                 small: int = 8) -> None:
        self.components = components
        self.hints = hints or {}
        self.small = small

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.components[schema["$ref"].rsplit("/", 1)[-1]]
        return schema

    def value(self, schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy:
        """A value for `schema`: one of its type (at the extremes too) most often, else anything."""
        valid = self.valid(schema, depth)
        return st.integers(0, 7).flatmap(lambda k: WRONG if k == 0 else valid)

    def valid(self, schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy:
        schema = self.resolve(schema)
        if "anyOf" in schema:
            return st.one_of([self.valid(option, depth) for option in schema["anyOf"]])
        kind = schema.get("type")
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind == "integer":
            # Valid and small (cheap to serve), the bounds and one past them, and the extremes.
            low, high = schema.get("minimum", 0), schema.get("maximum", 2**64)
            start = max(low, -1)
            bounds = [b + d for b in (schema.get("minimum"), schema.get("maximum")) if b is not None for d in (-1, 0, 1)]
            return st.one_of(st.integers(start, max(start, min(high, max(start, 0) + self.small))),
                             st.sampled_from(EXTREME_INTS + bounds))
        if kind == "number":
            return st.one_of(st.floats(-2, 2, allow_nan=False), st.sampled_from(EXTREME_FLOATS))
        if kind == "string":
            strings = st.one_of(st.text(max_size=12), st.sampled_from(EXTREME_STRINGS))
            return st.sampled_from(schema["enum"]) if "enum" in schema else strings
        if kind == "array":
            items = self.value(schema.get("items", {}), depth + 1) if depth < 3 else JSON_SCALARS
            return st.one_of(st.lists(items, max_size=4), st.sampled_from(RAW_VALUES[3:5]))
        if kind == "object" and "properties" in schema:
            return self.object(schema, depth)
        if kind == "object":
            values = self.value(schema.get("additionalProperties", {}), depth + 1) if depth < 3 else JSON_SCALARS
            return st.dictionaries(st.text(max_size=8), values, max_size=3)
        return ANY_JSON if depth < 3 else JSON_SCALARS  # {}: any value

    def object(self, schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy:
        """An object with every required property and some optional ones, any of them at its extremes."""
        properties = schema["properties"]
        required = {name: self.field(name, properties[name], depth) for name in schema.get("required", [])}
        optional = {name: self.field(name, prop, depth) for name, prop in properties.items() if name not in required}
        return st.fixed_dictionaries(required, optional=optional)

    def field(self, name: str, schema: dict[str, Any], depth: int) -> st.SearchStrategy:
        if name in self.hints:
            return st.integers(0, 7).flatmap(lambda k: WRONG if k == 0 else self.hints[name])
        return self.value(schema, depth + 1)

    def extreme(self, schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy:
        """A value of `schema`'s type at its extremes (or of another type, one time in four)."""
        schema = self.resolve(schema)
        if "anyOf" in schema:
            options = [o for o in schema["anyOf"] if o.get("type") != "null"] or schema["anyOf"]
            return st.one_of([self.extreme(option, depth) for option in options])
        kind = schema.get("type")
        if kind == "integer":
            bounds = [b + d for b in (schema.get("minimum"), schema.get("maximum")) if b is not None for d in (-1, 0, 1)]
            values = st.sampled_from(DANGEROUS_INTS + bounds)
        elif kind == "number":
            values = st.sampled_from(EXTREME_FLOATS)
        elif kind == "string":
            values = st.sampled_from(EXTREME_STRINGS)
        elif kind == "array":
            item = self.extreme(schema.get("items", {}), depth + 1) if depth < 3 else JSON_SCALARS
            values = st.one_of(st.just([]), st.lists(item, min_size=1, max_size=3), st.sampled_from(RAW_VALUES[:5]))
        elif kind == "object":
            values = st.one_of(st.just({}), self.valid(schema, depth), st.sampled_from(RAW_VALUES[1:2]))
        elif kind in ("boolean", "null"):
            values = self.valid(schema, depth)  # no extremes: both values, and the wrong types below
        else:
            values = st.one_of(st.sampled_from(RAW_VALUES), ANY_JSON)
        return st.integers(0, 3).flatmap(lambda k: WRONG if k == 0 else values)

    def extreme_field(self, name: str, schema: dict[str, Any]) -> st.SearchStrategy:
        extreme = self.extreme(schema)
        if name in self.hints and not schema.get("type") and "anyOf" not in schema:  # typed Any: the hint's shapes
            return st.one_of(self.hints[name], extreme)
        return extreme

    def body(self, name: str, base: st.SearchStrategy, *, max_fields: int = 3) -> st.SearchStrategy:
        """A body of the request schema `name`: `base` (a valid body) with one field at its extremes (half the
        time), or up to `max_fields` fields drawn from their schemas, or broken as a whole (one time in ten).
        Integer fields, where a value can overflow what the engine holds, are picked more often."""
        schema = self.resolve({"$ref": name})
        properties = schema["properties"]
        names = sorted(properties)
        numeric = [n for n in names if '"integer"' in json.dumps(properties[n])]
        one_extreme = st.sampled_from(names + numeric * 3).flatmap(
            lambda n: self.extreme_field(n, properties[n]).map(lambda value, n=n: {n: value}))
        several = st.lists(st.sampled_from(names), max_size=max_fields, unique=True).flatmap(
            lambda chosen: st.fixed_dictionaries({n: self.field(n, properties[n], 0) for n in chosen}))
        shaped = st.integers(0, 1).flatmap(lambda k: st.builds(lambda b, o: {**b, **o}, base,
                                                               one_extreme if k else several))
        return st.integers(0, 9).flatmap(lambda k: shaped if k else st.one_of(
            shaped.map(lambda b: {**b, "unknown_field": 1}),
            shaped.flatmap(lambda b: st.sampled_from(sorted(b) or [""]).map(
                lambda drop: {key: value for key, value in b.items() if key != drop})),
            WRONG,  # not an object
            st.just(Raw('{"prompt": "Hi",', "truncated JSON")),
        ))


def encode_body(body: Any) -> bytes:
    """`body` as JSON text, with every Raw in it put in as it is (NaN and infinity as json writes them)."""
    raws: dict[str, str] = {}

    def swap(value: Any) -> Any:
        if isinstance(value, Raw):
            marker = f"\u0001raw{len(raws)}\u0001"
            raws[json.dumps(marker)] = value.text
            return marker
        if isinstance(value, dict):
            return {key: swap(item) for key, item in value.items()}
        if isinstance(value, list):
            return [swap(item) for item in value]
        return value

    text = json.dumps(swap(body))
    for marker, raw in raws.items():
        text = text.replace(marker, raw, 1)
    return text.encode("utf-8", "surrogatepass")
