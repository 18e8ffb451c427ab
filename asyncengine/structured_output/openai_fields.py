"""The OpenAI and vLLM request fields that ask for structured output, turned into StructuredOutputsParams.

`response_format` (OpenAI): {"type": "text"} (nothing), {"type": "json_object"}, or {"type": "json_schema",
"json_schema": {"name", "schema", "strict", "description"}}. `structured_outputs` (vLLM's extra body): the
fields of StructuredOutputsParams. Both at once is a 400: which one should win is not for us to guess.
vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (with `guided_decoding_backend`
and `guided_whitespace_pattern`) are read as the structured_outputs keys of those names, and refused beside
either of the others in the same way.
"""

from __future__ import annotations

import json
from typing import Any

from asyncengine.errors import RequestError
from asyncengine.structured_output_spec import StructuredOutputsParams

_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "whitespace_pattern", "backend")


GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar", "guided_decoding_backend": "backend",
                "guided_whitespace_pattern": "whitespace_pattern"}


def from_request(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None,
                 guided: dict[str, Any] | None = None) -> StructuredOutputsParams | None:
    """`guided`: the request's guided_* fields that it set, by their names."""
    if guided:
        first = next(iter(guided))
        if structured_outputs is not None or response_format is not None:
            raise RequestError(f"{first} and {'structured_outputs' if structured_outputs is not None else 'response_format'}"
                               " both ask for structured output: send one", field=first)
        if guided.keys() <= {"guided_decoding_backend", "guided_whitespace_pattern"}:
            raise RequestError(f"{first} needs one of guided_json, guided_regex, guided_choice, guided_grammar",
                               field=first)
        structured_outputs = {GUIDED_KEYS[name]: value for name, value in guided.items()}
        if isinstance(structured_outputs.get("json"), str):  # vLLM takes the schema as an object or its text
            try:
                structured_outputs["json"] = json.loads(structured_outputs["json"])
            except ValueError as exc:
                raise RequestError(f"guided_json is not a JSON schema: {exc}", field="guided_json") from exc
        try:
            return from_request(None, structured_outputs)
        except RequestError as exc:  # named as the request named it
            field = exc.field or ""
            for name, key in GUIDED_KEYS.items():
                if field == f"structured_outputs.{key}" or field.startswith(f"structured_outputs.{key}."):
                    raise RequestError(exc.message.replace(f"structured_outputs.{key}", name),
                                       field=name + field[len(f"structured_outputs.{key}"):]) from exc
            raise
    from_format = _from_response_format(response_format) if response_format is not None else None
    if structured_outputs is not None:
        if from_format is not None:
            raise RequestError("response_format and structured_outputs both ask for structured output: send one",
                               field="structured_outputs")
        if not isinstance(structured_outputs, dict):
            raise RequestError("structured_outputs must be an object", field="structured_outputs")
        unknown = sorted(set(structured_outputs) - set(_FIELDS))
        if unknown:
            raise RequestError(f"structured_outputs has unknown fields {unknown}; it takes {', '.join(_FIELDS)}",
                               field="structured_outputs")
        params = StructuredOutputsParams(**structured_outputs)
        params.to_spec()  # exactly one constraint, of the right types: a 400 naming the field otherwise
        return params
    return from_format


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        if not isinstance(json_schema, dict):
            raise RequestError('response_format of type "json_schema" needs a "json_schema" object',
                               field="response_format.json_schema")
        schema = json_schema.get("schema")
        if schema is None:
            schema = {}  # OpenAI's default: any JSON value
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON schema (an object)",
                               field="response_format.json_schema.schema")
        return StructuredOutputsParams(json=schema)
    raise RequestError(f"response_format type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'",
                       field="response_format")
