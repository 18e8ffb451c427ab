"""ChoiceTrieBackend on a fake tokenizer: the masks follow the trie, EOS only after a whole choice."""

from __future__ import annotations

import numpy as np
import pytest

from ae_structured_output_example import ChoiceTrieBackend
from asyncengine import StructuredOutputsParams

EOS = 9


class CharTokenizer:
    """Token id = position of the character in "abcdefgh"."""

    def encode(self, text, add_special_tokens=False):
        return ["abcdefgh".index(c) for c in text]


def allowed(matcher):
    words = np.full((1, 1), -1, dtype=np.int32)
    matcher.fill_bitmask(words, 0)
    return [t for t in range(32) if (int(words[0, 0]) >> t) & 1]


def test_the_mask_follows_the_choices_and_allows_eos_only_after_a_whole_one():
    backend = ChoiceTrieBackend(CharTokenizer(), 10, [EOS])
    spec = StructuredOutputsParams(choice=["ab", "abc", "d"]).to_spec()
    matcher = backend.matcher(backend.compile(spec))
    assert allowed(matcher) == [0, 3]
    assert matcher.accept_token(0) and allowed(matcher) == [1]
    assert matcher.accept_token(1) and allowed(matcher) == [2, EOS]
    assert not matcher.is_terminated()
    assert matcher.accept_token(EOS) and matcher.is_terminated()


def test_a_token_outside_the_choices_is_refused():
    backend = ChoiceTrieBackend(CharTokenizer(), 10, [EOS])
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(choice=["ab"]).to_spec()))
    assert not matcher.accept_token(3)


def test_other_constraints_are_refused_naming_the_backend():
    with pytest.raises(ValueError, match="choice_trie supports only 'choice'"):
        ChoiceTrieBackend.validate(StructuredOutputsParams(regex="a+").to_spec())
