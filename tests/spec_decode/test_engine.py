"""Speculative decoding in the engine (issue 37, acceptance 1), on a tiny random Llama in float32: greedy output
token-identical to the same engine without speculation, with the n-gram proposer and with an oracle proposer
(registered in this process: the engine runs in it, the worker in a thread) that drafts the reference's own
tokens but spoils one position in five, so that steps accept all, some and none of their drafts. Under chunked
prefill, prefix-cache hits, preemption (a KV cache too small for the batch), async scheduling on and off; the
speculative counters add up, and every KV block is free once the requests are done.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.interfaces.stat_logger import StatLoggerBase
from asyncengine.interfaces.spec_decode import DraftTokens, ProposalBatch, Proposer, ProposerRegistry, register_proposer
from support.engine_checks import assert_all_blocks_free

NUM_TOKENS = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ORACLE = {"method": "test_oracle", "num_speculative_tokens": 3}
# Small enough for chunked prefill (the longest prompt takes 4 steps) and for preemption (8 prompts of up to 60
# tokens, 24 more each, in 9 blocks of 16 tokens, one more than max_model_len needs).
TIGHT = dict(max_num_batched_tokens=20, num_gpu_blocks_override=9, max_model_len=128)


class OracleProposer(Proposer):
    """Drafts what follows the request's history in one of `SEQUENCES` (prompt then reference output), every
    draft at a position divisible by 5 replaced by another token."""

    SEQUENCES: list[list[int]] = []
    calls = 0

    def propose(self, batch: ProposalBatch, num_speculative_tokens: int) -> DraftTokens:
        OracleProposer.calls += 1
        token_ids = np.zeros((len(batch), num_speculative_tokens), dtype=np.int64)
        counts = np.zeros(len(batch), dtype=np.int64)
        for row, length in enumerate(batch.num_tokens.tolist()):
            history = batch.token_ids[row, :length].tolist()
            for sequence in self.SEQUENCES:
                if sequence[:length] == history:
                    following = sequence[length:length + num_speculative_tokens]
                    for j, token in enumerate(following):
                        token_ids[row, j] = token if (length + j) % 5 else (token + 1) % self.context.vocab_size
                    counts[row] = len(following)
                    break
        return DraftTokens(token_ids=token_ids, num_draft_tokens=counts)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, model.vocab_size) for _ in range(40)]  # 2 full blocks: a prefix hit the 2nd time
    lengths = [3, 60, 17, 1, 33, 8]
    randoms = [[rng.randrange(3, model.vocab_size) for _ in range(n)] for n in lengths]
    # Repeating prompts, where the n-gram proposer finds drafts.
    repeats = [[5, 6, 7, 8] * 6, [3, 9] * 10 + [3]]
    return [shared + [11], shared + [12, 13]] + randoms + repeats


@pytest.fixture(scope="module")
def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3)


# Greedy with the sampler's steps before the temperature, which verification applies per drafted position.
STEERED = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, repetition_penalty=1.3,
                         frequency_penalty=0.4, presence_penalty=0.2, logit_bias={7: 3.0, 8: -2.0}, logprobs=2)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.fixture(scope="module")
def reference(model, prompts, params):
    """The same engine's outputs without speculation (and the oracle's sequences from them)."""
    with LLM(str(model.path), skip_tokenizer_init=True, **TIGHT) as llm:
        outputs = generate(llm, prompts, params)
        steered = generate(llm, prompts[-2:], STEERED)
    OracleProposer.SEQUENCES = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs)]
    return outputs, steered


@pytest.fixture(scope="module")
def oracle_registered():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProposerRegistry, "_entries", dict(ProposerRegistry._entries))
        register_proposer("test_oracle", OracleProposer)
        yield


def assert_same(outputs, reference) -> None:
    for got, want in zip(outputs, reference, strict=True):
        mine, theirs = got.outputs[0], want.outputs[0]
        assert mine.token_ids == theirs.token_ids
        assert mine.finish_reason == theirs.finish_reason == "length"
        # Logprobs as without speculation: the raw logits' at each emitted token's position.
        for step_mine, step_theirs in zip(mine.logprobs, theirs.logprobs, strict=True):
            assert step_mine.keys() == step_theirs.keys()
            assert all(abs(step_mine[t] - step_theirs[t]) < 1e-4 for t in step_mine)


def assert_counters_add_up(stats, num_speculative_tokens: int) -> None:
    per_position = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_position) == num_speculative_tokens
    assert stats.spec_decode_num_accepted_tokens == sum(per_position)
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))  # position j needs all before it
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_draft_tokens <= stats.spec_decode_num_drafts * num_speculative_tokens


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_oracle_drafts_accepted_in_part_give_the_same_tokens(model, prompts, params, reference, oracle_registered,
                                                            async_scheduling):
    calls = OracleProposer.calls
    with LLM(str(model.path), skip_tokenizer_init=True, speculative_config=ORACLE, async_scheduling=async_scheduling,
             **TIGHT) as llm:
        assert_same(generate(llm, prompts, params), reference[0])
        assert_same(generate(llm, prompts[:2], params), reference[0][:2])  # again: prefix hits, drafts from the start
        stats = llm.get_scheduler_stats()
    assert OracleProposer.calls > calls
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_counters_add_up(stats, 3)
    # The spoiled drafts are rejected, the others accepted: steps accept all, some and none.
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens_per_pos[2] > 0
    assert_all_blocks_free(stats)


class RecordingStatLogger(StatLoggerBase):
    """A stat logger as a plugin would have one: it keeps the scheduler stats `record` receives."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list = []

    def record(self, scheduler_stats, iteration_stats) -> None:
        if scheduler_stats is not None:
            self.received.append(scheduler_stats)


def test_ngram_gives_the_same_tokens_and_stat_loggers_get_the_counters(model, prompts, params, reference):
    stat_logger = RecordingStatLogger()
    with LLM(str(model.path), skip_tokenizer_init=True, speculative_config=NGRAM, **TIGHT) as llm:
        llm.engine.add_stat_logger(stat_logger)
        assert_same(generate(llm, prompts, params), reference[0])
        # Penalties and logit bias apply at each drafted position with the drafts before it in the history.
        assert_same(generate(llm, prompts[-2:], STEERED), reference[1])
        # Random sampling goes through the rejection test; a seeded request draws from its own generator.
        seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=NUM_TOKENS, ignore_eos=True)
        first, again = (generate(llm, prompts[-2:], seeded) for _ in range(2))
        assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
        stats = llm.get_scheduler_stats()
    assert stats.spec_decode_num_drafts > 0
    assert_counters_add_up(stats, 4)
    assert_all_blocks_free(stats)
    # Stat loggers receive vLLM's speculative counters with every step's scheduler stats.
    last = stat_logger.received[-1]
    assert (last.spec_decode_num_drafts, last.spec_decode_num_draft_tokens, last.spec_decode_num_accepted_tokens) == \
        (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens)


def test_an_unknown_method_fails_start_up_listing_the_registered_ones(model):
    with pytest.raises(Exception, match="'no_such_method' is not a registered proposer; registered: .*ngram"):
        LLM(str(model.path), skip_tokenizer_init=True,
            speculative_config={"method": "no_such_method", "num_speculative_tokens": 2})
