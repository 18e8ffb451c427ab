"""The n-gram proposer against a plain-Python reference written from vLLM's rule (longest suffix from
prompt_lookup_max down to prompt_lookup_min that occurs earlier; its earliest occurrence; the tokens after it,
at most k, to the end of the history and within max_model_len)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from asyncengine.config.speculative import parse_speculative_config
from asyncengine.interfaces.spec_decode import ProposalBatch, ProposerContext, ProposerRegistry
from asyncengine.worker.spec_decode.ngram import NgramProposer, propose_ngram


def reference(history: list[int], *, k: int, min_n: int, max_n: int, max_model_len: int) -> list[int]:
    length = len(history)
    room = min(k, max_model_len - length)
    if room <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        suffix = history[length - n:] if n <= length else None
        if suffix is None:
            continue
        for end in range(n, length):  # the match is history[end - n:end]; a token follows it
            if history[end - n:end] == suffix:
                return history[end:end + min(room, length - end)]
    return []


def batch_of(histories: list[list[int]], pad: int = -7) -> tuple[np.ndarray, np.ndarray]:
    width = max([len(h) for h in histories] + [1]) + 3  # wider than any history: padding is never read
    tokens = np.full((len(histories), width), pad, dtype=np.int64)
    for row, history in enumerate(histories):
        tokens[row, :len(history)] = history
    return tokens, np.array([len(h) for h in histories], dtype=np.int64)


def test_vllm_docstring_example():
    tokens, lengths = batch_of([[1, 2, 3, 4, 2, 3]])
    drafts, counts = propose_ngram(tokens, lengths, k=4, min_n=2, max_n=3, max_model_len=100)
    assert drafts[0, :counts[0]].tolist() == [4, 2, 3]


def test_earliest_occurrence_of_the_longest_suffix_wins():
    # [5, 6] occurs at 0 (followed by 1) and at 3 (followed by 2); the 3-gram [9, 5, 6] only at 2..5.
    history = [5, 6, 1, 5, 6, 2, 9, 5, 6, 3, 9, 5, 6]
    tokens, lengths = batch_of([history])
    drafts, counts = propose_ngram(tokens, lengths, k=2, min_n=2, max_n=2, max_model_len=100)
    assert drafts[0, :counts[0]].tolist() == [1, 5]
    drafts, counts = propose_ngram(tokens, lengths, k=2, min_n=2, max_n=3, max_model_len=100)
    assert drafts[0, :counts[0]].tolist() == [3, 9]


def test_no_match_shorter_than_min_and_max_model_len_bound():
    tokens, lengths = batch_of([[1, 2, 3, 1, 9], [4, 4, 4, 4, 4, 4], [], [7]])
    drafts, counts = propose_ngram(tokens, lengths, k=3, min_n=2, max_n=2, max_model_len=100)
    # [1, 9] never occurred; [4, 4] first occurs at 0..2 (overlapping the suffix's run), three 4s follow it
    assert counts.tolist() == [0, 3, 0, 0]
    drafts, counts = propose_ngram(tokens, lengths, k=3, min_n=2, max_n=2, max_model_len=7)
    assert counts.tolist() == [0, 1, 0, 0]  # one position left under max_model_len=7


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_reference_over_random_histories(seed):
    rng = random.Random(seed)
    for _ in range(20):
        vocab = rng.choice([2, 3, 5, 20])  # small vocabularies repeat n-grams often
        histories = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 60))] for _ in range(rng.randrange(1, 9))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 7)
        max_model_len = rng.randint(40, 70)
        tokens, lengths = batch_of(histories)
        drafts, counts = propose_ngram(tokens, lengths, k=k, min_n=min_n, max_n=max_n, max_model_len=max_model_len)
        got = [drafts[i, :counts[i]].tolist() for i in range(len(histories))]
        want = [reference(h, k=k, min_n=min_n, max_n=max_n, max_model_len=max_model_len) for h in histories]
        assert got == want, (histories, min_n, max_n, k, max_model_len)
        assert (drafts[np.arange(k)[None, :] >= counts[:, None]] == 0).all()  # padding is zeros


def test_the_registry_builds_the_ngram_proposer():
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    proposer_cls = ProposerRegistry.proposer_class(config.method)
    assert proposer_cls is NgramProposer
    proposer = proposer_cls(config, ProposerContext(vocab_size=50, max_model_len=100, max_num_seqs=4))
    tokens, lengths = batch_of([[1, 2, 3, 4, 2, 3], [8, 8, 8]])
    out = proposer.propose(ProposalBatch(token_ids=tokens, num_tokens=lengths), 3)
    # prompt_lookup_max alone: min = max = 2 (vLLM)
    assert out.as_lists() == [[4, 2, 3], [8]] and out.probs is None
