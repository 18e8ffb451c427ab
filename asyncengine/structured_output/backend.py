"""The structured-output backend interface (EXTENSION_POINTS.md, structured-output backends): GrammarMatcher and
StructuredOutputBackend are in the floor (asyncengine.interfaces.structured_output), imported here;
GrammarError and the bitmask width are here.

A backend turns a GrammarSpec into a compiled grammar (once per (backend, grammar), in a thread off
the engine core's step loop) and gives each request a matcher over it. The engine core asks each
matcher for the next token's bitmask before a step and feeds it every sampled token after one.

Bitmasks are vLLM's and xgrammar's layout: int32 words, bit `t % 32` of word `t // 32` set when
token `t` is allowed; one row per request, `ceil(vocab_size / 32)` words wide.
"""

from __future__ import annotations

from asyncengine.errors import RequestError
from asyncengine.interfaces.structured_output import GrammarMatcher, StructuredOutputBackend
from asyncengine.structured_output_spec import GrammarSpec


class GrammarError(RequestError):
    """The backend refused a grammar (an invalid schema, regex or grammar, or a feature it lacks)."""

    def __init__(self, backend: str, spec: GrammarSpec, reason: str) -> None:
        super().__init__(f"{spec.field} was refused by structured-output backend {backend!r}: {reason}",
                         field=spec.field)
        self.backend = backend
        self.reason = reason


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


__all__ = ["GrammarError", "GrammarMatcher", "StructuredOutputBackend", "bitmask_words"]
