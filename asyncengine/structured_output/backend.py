"""The structured-output backend interface (docs/reference.md, structured-output backends): GrammarMatcher and
StructuredOutputBackend are in the floor (asyncengine.interfaces.structured_output); GrammarError and the
bitmask width are here.

A backend turns a GrammarSpec into a compiled grammar (once per (backend, grammar), off the engine core's
event loop: compiling.py says where) and gives each request a matcher over it. The engine core asks each
matcher for the next token's bitmask before a step and feeds it every sampled token after one.

Bitmasks are vLLM's and xgrammar's layout: int32 words, bit `t % 32` of word `t // 32` set when
token `t` is allowed; one row per request, `ceil(vocab_size / 32)` words wide.
"""

from __future__ import annotations

from typing import Any

from asyncengine.errors import RequestError
from asyncengine.structured_output_spec import GrammarSpec


class GrammarError(RequestError):
    """The backend refused a grammar (an invalid schema, regex or grammar, or a feature it lacks)."""

    def __init__(self, backend: str, spec: GrammarSpec, reason: str) -> None:
        super().__init__(f"{spec.field} was refused by structured-output backend {backend!r}: {reason}",
                         field=spec.field)
        self.backend = backend
        self.reason = reason


class GrammarBroken(RequestError):
    """A constrained request cannot go on within its grammar: the grammar allows no next token (a dead end), or
    the token sampled is outside it (something after the mask refused every token the mask allowed). The
    request ends with this error rather than going on unconstrained."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}", field=field)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def load_tokenizer(tokenizer_dir: str | None, *, trust_remote_code: bool = False) -> Any:
    """The model's Hugging Face tokenizer, which backends build their token tables from (slow: in a thread)."""
    if tokenizer_dir is None:
        raise ValueError("structured outputs need the model's tokenizer, and the engine runs with skip_tokenizer_init")
    from transformers import AutoTokenizer

    # --trust-remote-code: the tokenizer may ship its own code
    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True, trust_remote_code=trust_remote_code)


__all__ = ["GrammarBroken", "GrammarError", "bitmask_words", "load_tokenizer"]
