"""What a request asks to be constrained to: `StructuredOutputsParams` (vLLM's name and fields) and
`GrammarSpec`, its resolved form that travels to the engine core inside SamplingOptions.

Plain request data, in the floor: SamplingParams holds it and the wire carries it, while the
structured-output backends and the grammar manager (asyncengine/structured_output/) compile and apply it.

Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` is set. A JSON schema given as a
dict is kept as its canonical JSON text, so equal schemas hash (and are cached) alike.
"""

from __future__ import annotations

import hashlib
import json as _json
from typing import Any

import msgspec

from asyncengine.errors import RequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


class GrammarSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One constraint, resolved: `kind` is one of KINDS, `text` its source (a JSON schema's text, a
    regex, a JSON list of choices, an EBNF/Lark grammar; empty for json_object). `backend` is the
    backend the request chose, None for the engine's default (structured_outputs_config)."""

    kind: str
    text: str
    whitespace_pattern: str | None = None
    backend: str | None = None

    @property
    def field(self) -> str:
        """The request field to blame for a problem with this constraint."""
        return f"structured_outputs.{self.kind}"

    def cache_key(self, backend: str) -> str:
        """(backend, grammar) as one hash: compiled grammars are shared by every request with it."""
        digest = hashlib.blake2b(digest_size=16)
        for part in (backend, self.kind, self.text, self.whitespace_pattern or ""):
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()


class StructuredOutputsParams(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's StructuredOutputsParams: `SamplingParams(structured_outputs=StructuredOutputsParams(json=...))`.

    `json`: a JSON schema (dict or its text); `regex`; `choice`: a list of strings; `grammar`: an EBNF
    (xgrammar: GBNF) or Lark (llguidance) grammar; `json_object`: any JSON object; `whitespace_pattern`:
    a regex for the whitespace between JSON tokens (where the backend has it); `backend`: a registered
    backend's name for this request (default: the engine's structured_outputs_config backend).
    """

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    backend: str | None = None

    def to_spec(self) -> GrammarSpec:
        """The resolved constraint; RequestError naming the field when the request is malformed."""
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise RequestError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object"
                + (f"; got {', '.join(given)}" if given else ""),
                field="structured_outputs",
            )
        kind = given[0]
        value = getattr(self, kind)
        field = f"structured_outputs.{kind}"
        if kind == "json":
            try:
                if isinstance(value, str):
                    try:
                        value = _json.loads(value)
                    except ValueError as exc:
                        raise RequestError(f"{field} is not valid JSON: {exc}", field=field) from exc
                if not isinstance(value, (dict, bool)):
                    raise RequestError(f"{field} must be a JSON schema (an object), got {type(value).__name__}",
                                       field=field)
                text = _json.dumps(value, sort_keys=True, separators=(",", ":"))
            except RecursionError as exc:  # hundreds of levels: the frontend's depth limit refuses far less
                raise RequestError(f"{field} nests objects and arrays too deep to read", field=field) from exc
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
                raise RequestError(f"{field} must be a non-empty list of strings", field=field)
            text = _json.dumps(list(value))
        elif kind == "json_object":
            if value is not True:
                raise RequestError(f"{field} must be true", field=field)
            text = ""
        else:
            if not isinstance(value, str) or not value:
                raise RequestError(f"{field} must be a non-empty string", field=field)
            text = value
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise RequestError("structured_outputs.whitespace_pattern must be a string",
                               field="structured_outputs.whitespace_pattern")
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise RequestError("structured_outputs.backend must be a backend's name",
                               field="structured_outputs.backend")
        return GrammarSpec(kind=kind, text=text, whitespace_pattern=self.whitespace_pattern, backend=self.backend)
