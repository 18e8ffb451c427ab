"""The bounds on a constraint's source, checked in the frontend before any backend parses it.

Parsing alone can be slow: xgrammar took 2.6 s to parse a 1.44 MB regex alternation (and minutes to compile
it), and its JSON-schema parser grows with the cube of the nesting depth (200 nested arrays, a 5 KB schema:
1.5 s; 400: 14 s). The frontend parses each new constraint (the backend's `validate`, a 400 before the request
is queued) in a thread nothing can interrupt, so the source is bounded before that: its size in bytes by kind
(EngineConfig's structured_outputs_max_*_bytes) and a JSON schema's nesting depth (MAX_SCHEMA_DEPTH). Each
exceeded bound is a RequestError naming the field and the option (or constant) that bounds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncengine.errors import RequestError
from asyncengine.structured_output_spec import GrammarSpec

if TYPE_CHECKING:
    from asyncengine.config.engine import EngineConfig

# Objects and arrays nested in a JSON schema document. OpenAI allows 10 levels of nested objects (each two
# levels here: the object and its "properties"); xgrammar parses 64 nested arrays in about 0.1 s.
MAX_SCHEMA_DEPTH = 64


@dataclass(frozen=True)
class SourceLimits:
    schema_bytes: int
    regex_bytes: int
    grammar_bytes: int

    @classmethod
    def of(cls, engine_config: EngineConfig) -> SourceLimits:
        return cls(schema_bytes=engine_config.structured_outputs_max_schema_bytes,
                   regex_bytes=engine_config.structured_outputs_max_regex_bytes,
                   grammar_bytes=engine_config.structured_outputs_max_grammar_bytes)

    def limit(self, kind: str) -> tuple[int, str]:
        """(the byte limit on a `kind` constraint's source, the option that sets it)."""
        if kind == "json":
            return self.schema_bytes, "structured_outputs_max_schema_bytes"
        if kind == "regex":
            return self.regex_bytes, "structured_outputs_max_regex_bytes"
        return self.grammar_bytes, "structured_outputs_max_grammar_bytes"  # grammar, choice (json_object: empty)

    def check(self, spec: GrammarSpec) -> None:
        """RequestError naming the field and the bound when `spec`'s source exceeds one."""
        limit, option = self.limit(spec.kind)
        _check_size(spec.field, spec.text, limit, option)
        if spec.whitespace_pattern is not None:
            _check_size("structured_outputs.whitespace_pattern", spec.whitespace_pattern, self.regex_bytes,
                        "structured_outputs_max_regex_bytes")
        if spec.kind == "json":
            depth = nesting_depth(json.loads(spec.text))
            if depth > MAX_SCHEMA_DEPTH:
                raise RequestError(
                    f"{spec.field} nests objects and arrays {depth} deep, over the limit of {MAX_SCHEMA_DEPTH} "
                    "(a schema's nesting makes its parsing slow): flatten it, with $defs and $ref for repeated parts",
                    field=spec.field, code="invalid_value")


def _check_size(field: str, text: str, limit: int, option: str) -> None:
    size = len(text.encode())
    if size > limit:
        raise RequestError(
            f"{field} is {size:,} bytes, over the limit of {limit:,} bytes ({option}, the server's "
            f"--{option.replace('_', '-')}): send a smaller one, or raise the limit", field=field,
            code="string_above_max_length")


def nesting_depth(document: Any) -> int:
    """How deep objects and arrays nest in a parsed JSON document (a scalar: 0). Iterative: no recursion limit."""
    deepest = 0
    stack = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest
