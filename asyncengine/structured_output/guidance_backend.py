"""The second backend: llguidance (PyPI `llguidance`). JSON schemas, regexes, choices, Lark (or GBNF) grammars.

Its compiles run in a thread of the engine core (not the grammar-compile process): llguidance bounds its own
work with its parser limits (lexer states, lexer fuel), and refused the 1.44 MB regex alternation that xgrammar
compiled for minutes in 1.2 s ("initial lexer configuration (grammar) too big").
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from asyncengine.interfaces.structured_output import GrammarMatcher, StructuredOutputBackend
from asyncengine.structured_output_spec import GrammarSpec


BOUNDED_WHITESPACE = r"[ \t\n\r]{0,12}"  # between two JSON tokens


def _grammar(spec: GrammarSpec) -> str:
    import llguidance

    if spec.kind == "json":
        # As xgrammar_backend: flexible whitespace, bounded per gap, unless the request gives its own pattern.
        return llguidance.LLMatcher.grammar_from_json_schema(
            spec.text, overrides={"whitespace_pattern": spec.whitespace_pattern or BOUNDED_WHITESPACE})
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", spec.text)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    return llguidance.grammar_from("grammar", spec.text)  # Lark, or GBNF converted to Lark


def _check(grammar: str, tokenizer: Any = None) -> None:
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise ValueError("; ".join(messages))


class _Matcher(GrammarMatcher):
    def __init__(self, matcher: Any, eos_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._eos_token_ids = eos_token_ids
        self._ended = False

    def accept_token(self, token_id: int) -> bool:
        accepted = self._matcher.consume_token(token_id) and not self._matcher.is_error()
        # llguidance stops as soon as only EOS can follow; like xgrammar, the grammar ends with the EOS itself,
        # so that the last token of the text is never mistaken for the EOS.
        self._ended = accepted and token_id in self._eos_token_ids
        return accepted

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)
        if self._matcher.is_error():
            # A dead end (`root ::= root`, a regex matching nothing, a grammar that cannot go on from here):
            # llguidance then allows only the EOS, which would end the output unmatched. No token at all is
            # how the engine core recognises a dead end (manager.py): the request fails, naming its grammar.
            bitmask[row] = 0

    def is_terminated(self) -> bool:
        return self._ended


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        import llguidance.hf

        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                       eos_token=list(eos_token_ids)[0] if eos_token_ids else None)

    @classmethod
    def validate(cls, spec: GrammarSpec) -> None:
        try:
            _check(_grammar(spec))
        except ValueError as exc:
            raise ValueError(str(exc).strip()) from exc

    def compile(self, spec: GrammarSpec) -> Any:
        grammar = _grammar(spec)
        _check(grammar, self._tokenizer)
        return grammar  # llguidance builds its parser per matcher (cheap; it drops the GIL)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return _Matcher(matcher, frozenset(self.eos_token_ids))

    def compiled_size(self, compiled: Any) -> int:
        # The compiled form kept here is the grammar's text (llguidance builds its lexer per matcher, bounded by
        # its own limits on lexer states and work): its size is what the cache holds.
        return len(compiled.encode()) if isinstance(compiled, str) else super().compiled_size(compiled)
