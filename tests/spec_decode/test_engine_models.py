"""The proposers with a model of their own, through the engine's step (issue 37, acceptance 1), in float32 on
tiny random models: greedy output token-identical to the same engine without speculation.

- draft_model: a random draft other than the target (few drafts accepted), and the target as its own draft
  (every draft accepted, from the speculative counters); under chunked prefill and preemption (a KV cache too
  small for the batch), and a request aborted mid-stream: every KV block, the target's and the draft's, is
  free once the requests are done. A draft of another vocabulary fails start-up, naming both.
- eagle / eagle3 on a "bigram" target (support/eagle_heads.py): random heads (EAGLE-3's target layers by
  vLLM's default), whose proposers here record the target states they are given: those equal transformers'
  hidden states at the positions ProposalBatch names (the final states; the residual streams entering the
  chosen layers), over chunked prefill and verification steps; and heads that copy the target, accepted in
  full.
"""

from __future__ import annotations

import copy
import random

import anyio
import numpy as np
import pytest
import torch

from asyncengine import LLM, AsyncEngine, EngineConfig, SamplingParams
from asyncengine.errors import ConfigError
from asyncengine.interfaces.spec_decode import ProposalBatch, ProposerRegistry, register_proposer
from asyncengine.server.startup_log import startup_summary
from asyncengine.worker.spec_decode.eagle import Eagle3Proposer, EagleProposer
from support.eagle_heads import VOCAB, bigram_llama, copying_head, head_config, random_tensors, save_head
from support.engine_checks import assert_all_blocks_free

NUM_TOKENS = 16
K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
# Chunked prefill (the 37-token prompt takes 3 steps) and preemption (6 prompts in 8 blocks of 16 tokens).
TIGHT = dict(max_num_batched_tokens=16, num_gpu_blocks_override=8, max_model_len=96, skip_tokenizer_init=True)
EAGLE_TIGHT = TIGHT | dict(num_gpu_blocks_override=4, max_model_len=64)  # (the EAGLE prompts are shorter)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def assert_nothing_held(llm: LLM) -> None:
    """No target block referenced, and the proposer's own cache holds no request and every block free."""
    assert_all_blocks_free(llm.get_scheduler_stats())
    (usage,) = llm.collective_rpc("speculative_kv_cache_usage")
    assert usage["num_requests"] == 0 and usage["num_free_blocks"] == usage["num_blocks"] > 0, usage


def speculative(method: str, model, k: int = K) -> dict:
    return {"method": method, "model": str(model), "num_speculative_tokens": k}


# -- draft_model -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, target.vocab_size) for _ in range(n)] for n in (5, 37, 12, 1, 20, 9)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    with LLM(str(target.path), **TIGHT) as llm:
        return generate(llm, prompts)


def perturbed_copy(model, directory, *, scale: float, seed: int):
    """`model` (transformers') with noise of `scale` times each weight's spread added: a draft that agrees with
    it on some tokens only."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    draft.save_pretrained(directory)
    return directory


def test_a_draft_that_agrees_in_part_gives_the_targets_tokens(target, prompts, reference, tmp_path_factory):
    draft = perturbed_copy(target.hf_model, tmp_path_factory.mktemp("draft"), scale=0.05, seed=3)
    # A KV budget of 16 blocks of the tiny Llama's (2 layers x K and V x 16 tokens x 2 heads x 16 dims x 4 bytes),
    # shared by the target and a draft of the same shape: 8 blocks each.
    budget = {k: v for k, v in TIGHT.items() if k != "num_gpu_blocks_override"} | {"kv_cache_memory_bytes": 16 * 8192}
    with LLM(str(target.path), speculative_config=speculative("draft_model", draft), **budget) as llm:
        assert generate(llm, prompts) == reference
        for _ in range(2):  # the second time, a prefix hit for the target (the draft computes it all)
            assert generate(llm, prompts[1:2]) == reference[1:2]
        stats = llm.get_scheduler_stats()
        assert_nothing_held(llm)
        summary = startup_summary(str(target.path), llm.engine.startup_report)
    # The draft's cache, beside the target's in serve's start-up summary: as many blocks (and its block 0).
    at = next(i for i, line in enumerate(summary) if line.startswith("KV cache: 8 blocks of 16 tokens"))
    assert summary[at + 1].startswith(f"speculative proposer: draft model LlamaForCausalLM ({draft})")
    assert "draft KV cache: 9 blocks of 16 tokens" in summary[at + 1]
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens, stats


async def _stream_and_abort(config: EngineConfig, prompts: list[list[int]]) -> tuple[list[list[int]], int, object]:
    """Every prompt to the end, concurrently, and one more request aborted after its third output."""
    results: dict[int, list[int]] = {}
    aborted_tokens = 0
    async with AsyncEngine.start(config) as engine:
        async def run(index: int, prompt: list[int]) -> None:
            tokens: list[int] = []
            async for out in engine.generate({"prompt_token_ids": prompt}, GREEDY):
                tokens.extend(out.outputs[0].token_ids)
            results[index] = tokens

        async def abandon() -> None:
            nonlocal aborted_tokens
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            async with engine.stream({"prompt_token_ids": prompts[1] + prompts[2]}, params) as outputs:
                count = 0
                async for out in outputs:
                    aborted_tokens += len(out.outputs[0].token_ids)
                    count += 1
                    if count == 3:
                        break

        async with anyio.create_task_group() as tg:
            for index, prompt in enumerate(prompts):
                tg.start_soon(run, index, prompt)
            tg.start_soon(abandon)
        for _ in range(100):  # the abort reaches the engine core in its next step
            stats = await engine.get_scheduler_stats()
            if stats.num_running_reqs == stats.num_waiting_reqs == 0:
                break
            await anyio.sleep(0.05)
        (usage,) = await engine.collective_rpc("speculative_kv_cache_usage")
    return [results[i] for i in range(len(prompts))], aborted_tokens, (stats, usage)


def test_the_target_as_its_own_draft_is_accepted_in_full_and_an_abort_frees_all(target, prompts, reference):
    config = EngineConfig(model=str(target.path), speculative_config=speculative("draft_model", target.path),
                          **TIGHT)
    outputs, aborted_tokens, (stats, usage) = anyio.run(_stream_and_abort, config, prompts)
    assert outputs == reference
    assert 0 < aborted_tokens < 40
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens  # 100%
    assert_all_blocks_free(stats)
    assert usage["num_requests"] == 0 and usage["num_free_blocks"] == usage["num_blocks"], usage


def test_a_draft_of_another_vocabulary_fails_start_up_naming_both(target, tiny_model):
    other = tiny_model("qwen2")  # 1001 tokens against the target's 997
    with pytest.raises(ConfigError, match="has a vocabulary of 1001 tokens, the target .* one of 997") as info:
        LLM(str(target.path), speculative_config=speculative("draft_model", other.path), **TIGHT)
    assert str(other.path) in str(info.value) and str(target.path) in str(info.value)
    # The draft's quantization method is checked there too, against the registered ones.
    with pytest.raises(ConfigError, match="speculative_config.quantization, the draft's: .*'no_such_method'"):
        LLM(str(target.path), speculative_config=speculative("draft_model", target.path) | {
            "quantization": "no_such_method"}, **TIGHT)


# -- EAGLE and EAGLE-3 ---------------------------------------------------------------------------------------

class RecordingEagle(EagleProposer):
    """EAGLE as built in, keeping what each step gives it: (history, num_hidden_states, rows) per request."""

    records: list[tuple[list[int], int, torch.Tensor]] = []

    def propose(self, batch: ProposalBatch, num_speculative_tokens: int):
        counts = batch.num_hidden_states if batch.num_hidden_states is not None else np.ones(len(batch), int)
        starts = np.concatenate([[0], np.cumsum(counts)])
        for i, n in enumerate(batch.num_tokens.tolist()):
            type(self).records.append((batch.token_ids[i, :n].tolist(), int(counts[i]),
                                       batch.hidden_states[starts[i]:starts[i + 1]].clone()))
        return super().propose(batch, num_speculative_tokens)


class RecordingEagle3(RecordingEagle, Eagle3Proposer):
    records: list[tuple[list[int], int, torch.Tensor]] = []


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    hf = bigram_llama()
    directory = tmp_path_factory.mktemp("bigram")
    hf.save_pretrained(directory)
    return hf, directory


@pytest.fixture(scope="module")
def eagle_prompts() -> list[list[int]]:
    # Histories stay under 44 positions (copying_head's EAGLE-3 attention).
    rng = random.Random(5)
    return [[rng.randrange(3, 997) for _ in range(n)] for n in (4, 27, 9, 1, 14)]


@pytest.fixture(scope="module")
def eagle_reference(bigram, eagle_prompts):
    with LLM(str(bigram[1]), **TIGHT) as llm:
        return generate(llm, eagle_prompts)


@pytest.fixture(scope="module")
def recording_registered():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProposerRegistry, "_entries", dict(ProposerRegistry._entries))
        register_proposer("test_eagle", RecordingEagle)
        register_proposer("test_eagle3", RecordingEagle3)
        yield


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_random_heads_get_the_targets_states_and_give_its_tokens(method, bigram, eagle_prompts, eagle_reference,
                                                                 recording_registered, tmp_path):
    hf, directory = bigram
    extra = {"draft_vocab_size": VOCAB - 97} if method == "eagle3" else {}  # (EAGLE-3: vLLM's default layers)
    head = save_head(tmp_path / "head", head_config(method, **extra), random_tensors(method, seed=11))
    recorder = RecordingEagle3 if method == "eagle3" else RecordingEagle
    recorder.records = []
    with LLM(str(directory), speculative_config=speculative(f"test_{method}", head), **EAGLE_TIGHT) as llm:
        assert generate(llm, eagle_prompts) == eagle_reference
        for _ in range(2):  # the second time, a prefix hit: the head is given the positions after it only
            assert generate(llm, eagle_prompts[1:2]) == eagle_reference[1:2]
        assert_nothing_held(llm)
        stats = llm.get_scheduler_stats()
    assert stats.spec_decode_num_drafts > 0 and stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    layers = (2, 1, 0) if method == "eagle3" else ()  # (2, L // 2, L - 3) of the 3-layer target
    # The target is causal: each history's states are those of its request's whole sequence at its positions.
    sequences = [prompt + output for prompt, output in zip(eagle_prompts, eagle_reference)]
    with torch.inference_mode():
        outs = [hf(input_ids=torch.tensor([sequence]), output_hidden_states=True) for sequence in sequences]
    expected = [torch.cat([out.hidden_states[i][0] for i in layers], dim=-1) if layers else out.hidden_states[-1][0]
                for out in outs]
    checked = 0
    for history, given, rows in recorder.records:
        n = len(history)
        (states,) = [e for e, sequence in zip(expected, sequences) if sequence[:n] == history]
        torch.testing.assert_close(rows, states[n - 1 - given:n - 1], atol=2e-4, rtol=1e-4)
        checked += given
    # Every position's state reached the head once at least (prompts in chunks; verified positions); some more
    # than once (recomputed after a preemption, or the prompt run again).
    assert checked >= sum(len(p) + NUM_TOKENS - 1 for p in eagle_prompts)


def test_a_head_of_another_vocabulary_fails_start_up(bigram, tmp_path):
    head = save_head(tmp_path / "wide", head_config("eagle", vocab_size=1001), random_tensors("eagle", seed=2))
    with pytest.raises(ConfigError, match="the EAGLE head .* has a vocabulary of 1001 tokens, the target .* one of 997"):
        LLM(str(bigram[1]), speculative_config=speculative("eagle", head), **EAGLE_TIGHT)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_head_copying_the_target_is_accepted_in_full(method, bigram, eagle_prompts, eagle_reference, tmp_path):
    hf, directory = bigram
    config, tensors = copying_head(method, hf)
    head = save_head(tmp_path / "copy", config, tensors)
    # (EAGLE with async scheduling off, EAGLE-3 with it on, the default: the other tests run with it on)
    with LLM(str(directory), speculative_config=speculative(method, head), async_scheduling=method == "eagle3",
             **EAGLE_TIGHT) as llm:
        assert generate(llm, eagle_prompts) == eagle_reference
        assert_nothing_held(llm)
        stats = llm.get_scheduler_stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens, stats  # 100%
    assert stats.num_preemptions > 0, stats
