"""The structured-output backend interface (docs/reference.md), and the table of backends.

A backend turns a GrammarSpec into a compiled grammar (once per (backend, grammar), off the engine core's
event loop) and gives each request a matcher over it. The engine core asks each
matcher for the next token's bitmask before a step and feeds it every sampled token after one.

Bitmasks are vLLM's and xgrammar's layout: int32 words, bit `t % 32` of word `t // 32` set when
token `t` is allowed; one row per request, `ceil(vocab_size / 32)` words wide.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, ClassVar

from asyncengine.interfaces.registry import BUILT_IN, Registry
from asyncengine.structured_output_spec import GrammarSpec  # what a backend compiles (request data, floor)

if TYPE_CHECKING:
    import numpy as np


class GrammarMatcher:
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by the sampled token; False when the grammar does not allow it."""
        raise NotImplementedError

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, see the module's doc)."""
        raise NotImplementedError

    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted."""
        raise NotImplementedError


class StructuredOutputBackend:
    """Subclass and register with `register_structured_output_backend("name", "pkg.mod:Class")`.

    Built once per engine core, lazily, with the model's tokenizer (a Hugging Face tokenizer), the
    logits' vocabulary size and the model's EOS token ids. `compile` and `matcher` run in worker threads, so
    they must be safe to call from several threads; `validate` runs in the frontend, without a tokenizer,
    to answer a bad grammar with a 400 before the request reaches the engine.
    """

    name: ClassVar[str] = ""
    # True: a compile of a large source (over structured_output/compiling.py's INLINE_COMPILE_BYTES) runs first
    # in the engine core's grammar-compile process, where the time limit and an aborted request can stop it (it
    # is killed), and only a compile that finished there runs again in the engine core. The class is built there
    # from its "module:qualname" path, so it must be importable in a fresh interpreter. False: every compile
    # runs in a thread of the engine core, which nothing can stop (docs/structured_outputs.md, "Bounds").
    isolated_compile: ClassVar[bool] = False

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    @classmethod
    def validate(cls, spec: GrammarSpec) -> None:
        """Raise ValueError (its message is the backend's) when `spec` cannot be compiled. Default: no check."""

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar for `spec` (raise ValueError with the backend's message when it cannot)."""
        raise NotImplementedError

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of `compiled`."""
        raise NotImplementedError

    def compiled_size(self, compiled: Any) -> int:
        """The bytes `compiled` holds, charged to the compiled-grammar cache's budget. Default: an estimate
        from the Python objects it reaches (`estimate_size`), which sees no native memory: a backend whose
        compiled grammars hold native memory says what it holds (as xgrammar's memory_size_bytes)."""
        return estimate_size(compiled)


def estimate_size(root: Any, *, max_objects: int = 1_000_000) -> int:
    """sys.getsizeof of every object reachable from `root` through containers, instance dicts and slots,
    each counted once (the first `max_objects` of them: a bound on the time it takes)."""
    seen: set[int] = set()
    total = 0
    stack = [root]
    while stack and len(seen) < max_objects:
        value = stack.pop()
        if id(value) in seen or isinstance(value, type):
            continue
        seen.add(id(value))
        total += sys.getsizeof(value)
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        elif not isinstance(value, (str, bytes, bytearray, int, float, bool)) and value is not None:
            if hasattr(value, "__dict__"):
                stack.append(vars(value))
            for slot in getattr(type(value), "__slots__", ()):
                if hasattr(value, slot):
                    stack.append(getattr(value, slot))
    return total


# -- the table of backends (read in the frontend, which checks grammars, and the engine core) ------------

StructuredOutputBackendRegistry: Registry[type[StructuredOutputBackend]] = Registry(
    "structured_output_backends", "structured-output backend", StructuredOutputBackend,
    field="structured_outputs_config",
    unknown="unknown structured-output backend {key!r} (registered: {known}); register one with "
            "register_structured_output_backend")
StructuredOutputBackendRegistry.register(
    "xgrammar", "asyncengine.structured_output.xgrammar_backend:XgrammarBackend", owner=BUILT_IN)
StructuredOutputBackendRegistry.register(
    "guidance", "asyncengine.structured_output.guidance_backend:GuidanceBackend", owner=BUILT_IN)


__all__ = ["GrammarMatcher", "StructuredOutputBackend", "StructuredOutputBackendRegistry", "estimate_size"]
