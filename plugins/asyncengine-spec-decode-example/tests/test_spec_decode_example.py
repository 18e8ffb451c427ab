"""The proposer alone: its drafts, its bounds, its registration."""

from __future__ import annotations

import numpy as np
import pytest

import ae_spec_decode_example
from ae_spec_decode_example import CALLS, METHOD, RepeatLastProposer
from asyncengine.plugins_api import ProposalBatch, ProposerContext, ProposerRegistry, SpeculativeConfig


def test_it_drafts_the_last_token_repeated_within_max_model_len():
    config = SpeculativeConfig(method=METHOD, num_speculative_tokens=3)
    proposer = RepeatLastProposer(config, ProposerContext(vocab_size=50, max_model_len=8, max_num_seqs=2))
    history = np.array([[4, 5, 6, 0, 0, 0, 0], [7, 7, 9, 9, 9, 9, 2]])
    before = CALLS["propose"]
    drafts = proposer.propose(ProposalBatch(token_ids=history, num_tokens=np.array([3, 7])), 3)
    assert drafts.as_lists() == [[6, 6, 6], [2]]  # the second has room for one token more
    assert CALLS["propose"] == before + 1
    capped = RepeatLastProposer(SpeculativeConfig(method=METHOD, num_speculative_tokens=3, prompt_lookup_max=2),
                                ProposerContext(vocab_size=50, max_model_len=64, max_num_seqs=2))
    assert capped.propose(ProposalBatch(token_ids=history, num_tokens=np.array([3, 7])), 3).as_lists() == \
        [[6, 6], [2, 2]]


def test_register_names_the_method(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(ProposerRegistry, "_entries", dict(ProposerRegistry._entries))
    ae_spec_decode_example.register()
    assert ProposerRegistry.proposer_class(METHOD) is RepeatLastProposer
