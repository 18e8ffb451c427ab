"""The default backend: xgrammar (PyPI `xgrammar`). JSON schemas, regexes, choices, GBNF grammars."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from asyncengine.interfaces.structured_output import GrammarMatcher, StructuredOutputBackend
from asyncengine.structured_output_spec import GrammarSpec


MAX_WHITESPACE = 12  # whitespace characters allowed between two JSON tokens


def _grammar(spec: GrammarSpec) -> Any:
    """The xgrammar Grammar of `spec`: parsing it needs no tokenizer, so the frontend can check it."""
    import xgrammar

    if spec.kind == "json":
        # Flexible whitespace (small models like to indent), but bounded per gap: an unbounded run is where a
        # small model can loop ("\n   \n   ...") until max_tokens instead of closing the document.
        if spec.whitespace_pattern is None:
            return xgrammar.Grammar.from_json_schema(spec.text, any_whitespace=True,
                                                     max_whitespace_cnt=MAX_WHITESPACE)
        return xgrammar.Grammar.from_json_schema(spec.text, any_whitespace=False)
    if spec.kind == "json_object":
        return xgrammar.Grammar.builtin_json_grammar()
    if spec.kind == "regex":
        return xgrammar.Grammar.from_regex(spec.text)
    if spec.kind == "choice":
        choices = json.loads(spec.text)
        return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(choice) for choice in choices))
    return xgrammar.Grammar.from_ebnf(spec.text)


class _Matcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        # xgrammar writes into a torch tensor; torch.from_numpy shares the array's memory.
        self._matcher.fill_next_token_bitmask(torch.from_numpy(bitmask), row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"
    # xgrammar cannot stop a compile (a 1.44 MB regex alternation compiles for minutes): large sources are
    # compiled first in the grammar-compile process, which can be killed (compiling.py).
    isolated_compile = True

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(eos_token_ids) or None)
        # Ours is the only cache (compiling.py: a byte budget, least recently used out): xgrammar's own,
        # unbounded by default, would keep every grammar ours evicts.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    @classmethod
    def validate(cls, spec: GrammarSpec) -> None:
        try:
            _grammar(spec)
        except (RuntimeError, ValueError) as exc:  # xgrammar's parse errors are RuntimeErrors
            raise ValueError(str(exc).strip()) from exc

    def compile(self, spec: GrammarSpec) -> Any:
        try:
            return self._compiler.compile_grammar(_grammar(spec))
        except (RuntimeError, ValueError) as exc:
            raise ValueError(str(exc).strip()) from exc

    def matcher(self, compiled: Any) -> GrammarMatcher:
        import xgrammar

        return _Matcher(xgrammar.GrammarMatcher(compiled))

    def compiled_size(self, compiled: Any) -> int:
        # xgrammar's own figure ("approximate"): its token-mask cache and grammar. On JSON schemas of thousands
        # of properties the RSS a compile keeps measured up to 2.5 times it; a compile in the grammar-compile
        # process is charged the larger of the two (compiler_main.py).
        return int(compiled.memory_size_bytes)
