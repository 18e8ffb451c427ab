"""choice_trie: a structured-output backend for `choice` constraints, as a plugin would write one.

It imports only asyncengine.plugins_api. Registered by `register()` (the general-plugin entry point).
"""

from __future__ import annotations

import json
import os

import numpy as np

from asyncengine.plugins_api import (
    GrammarMatcher,
    StructuredOutputBackend,
    current_process_role,
    register_structured_output_backend,
)

__all__ = ["ChoiceTrieBackend", "register"]

NAME = "choice_trie"


def _record(event: str) -> None:
    """With AE_PLUGIN_RECORD set, append where this event happened (the e2e tests read it)."""
    path = os.environ.get("AE_PLUGIN_RECORD")
    if path:
        with open(path, "a") as file:
            file.write(json.dumps({"plugin": "ae_structured_output_example", "event": event, "pid": os.getpid(),
                                   "role": current_process_role()}) + "\n")


class _Trie:
    def __init__(self, sequences: list[list[int]]) -> None:
        self.children: dict[int, _Trie] = {}
        self.is_end = False
        for sequence in sequences:
            node = self
            for token_id in sequence:
                node = node.children.setdefault(token_id, _Trie([]))
            node.is_end = True


class _Matcher(GrammarMatcher):
    def __init__(self, trie: _Trie, eos_token_ids: list[int]) -> None:
        self._node: _Trie | None = trie
        self._eos = eos_token_ids
        self._ended = False
        self._recorded = False

    def accept_token(self, token_id: int) -> bool:
        node = self._node
        if node is None:
            return False
        if node.is_end and token_id in self._eos:
            self._node, self._ended = None, True
            return True
        self._node = node.children.get(token_id)
        return self._node is not None

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        if not self._recorded:
            _record("mask computed")
            self._recorded = True
        allowed = list(self._node.children) if self._node is not None else []
        if self._node is not None and self._node.is_end:
            allowed += self._eos
        words = np.zeros(bitmask.shape[1], dtype=np.uint32)
        for token_id in allowed:
            words[token_id // 32] |= np.uint32(1 << (token_id % 32))
        bitmask[row] = words.view(np.int32)

    def is_terminated(self) -> bool:
        return self._ended


class ChoiceTrieBackend(StructuredOutputBackend):
    name = NAME

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        _record("backend built")

    @classmethod
    def validate(cls, spec) -> None:
        if spec.kind != "choice":
            raise ValueError(f"{NAME} supports only 'choice' constraints, not {spec.kind!r}")

    def compile(self, spec) -> _Trie:
        self.validate(spec)
        choices = json.loads(spec.text)
        return _Trie([self.tokenizer.encode(choice, add_special_tokens=False) for choice in choices])

    def matcher(self, compiled: _Trie) -> GrammarMatcher:
        return _Matcher(compiled, self.eos_token_ids)


def register() -> None:
    register_structured_output_backend(NAME, "ae_structured_output_example:ChoiceTrieBackend")
