"""Greedy parity with transformers (float32, eager attention) on tiny random models.

Each scenario runs a batch of 8 prompts of mixed lengths through `LLM.generate` and compares every
sequence with transformers decoding that prompt alone: tokens identical over 32 generated tokens
(a divergence is accepted only as a tie, see tests/support/hf_reference.py) and top-5 logprobs within
1e-3. The scenarios force the paths that could break parity: prefix-cache hits, chunked prefill,
and preemption under a KV cache too small for the batch.
"""

from __future__ import annotations

import random

import pytest

from asyncengine import LLM, SamplingParams
from support.engine_checks import assert_all_blocks_free
from support.hf_reference import assert_bfloat16_rule, compare_greedy, compare_low_precision, hf_greedy

NUM_TOKENS = 32
MODELS = ["llama", "qwen2", "qwen3"]


def make_prompts(vocab_size: int, seed: int, *, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(shared_prefix)]
    lengths = [3, 60, 17, 1, 33, 8, 47, 25]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def run_and_compare(llm: LLM, model, prompts: list[list[int]], parity_record) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert output.finished and completion.finish_reason == "length"
        reference = hf_greedy(model.hf_model, prompt, NUM_TOKENS)
        result = compare_greedy(completion.token_ids, completion.logprobs, reference)
        assert result.max_logprob_error < 1e-3, f"top-5 logprobs differ by {result.max_logprob_error}"
        for step_logprobs in completion.logprobs[: result.num_compared]:
            assert len(step_logprobs) in (5, 6)  # the chosen token, and the top 5 (it may be among them)
        parity_record["sequences"] += 1
        parity_record["tokens"] += result.num_compared
        parity_record["ties"] += int(result.tie)
    return outputs


def assert_no_leak(llm: LLM) -> None:
    assert_all_blocks_free(llm.get_scheduler_stats())


@pytest.mark.parametrize("name", MODELS)
def test_batch_of_mixed_lengths(tiny_model, parity_record, make_llm, name):
    model = tiny_model(name)
    llm = make_llm(str(model.path), skip_tokenizer_init=True, max_model_len=256)
    run_and_compare(llm, model, make_prompts(model.vocab_size, seed=1), parity_record)
    assert_no_leak(llm)


@pytest.mark.parametrize("name", MODELS)
def test_prefix_cache_hits(tiny_model, parity_record, make_llm, name):
    model = tiny_model(name)
    llm = make_llm(str(model.path), skip_tokenizer_init=True, max_model_len=256, block_size=8)
    prompts = make_prompts(model.vocab_size, seed=2, shared_prefix=40)
    first = run_and_compare(llm, model, prompts, parity_record)
    second = run_and_compare(llm, model, prompts, parity_record)
    # The second run finds every full block of each prompt in the cache, except that a prompt made
    # only of full blocks recomputes its last block (the last token's logits are needed).
    for prompt, output in zip(prompts, second):
        full_blocks = len(prompt) // 8 - (len(prompt) % 8 == 0)
        assert output.num_cached_tokens == full_blocks * 8
    # Within the first run, every prompt but the one scheduled first finds the shared 40-token prefix.
    assert sum(o.num_cached_tokens >= 40 for o in first) >= len(first) - 1
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert_no_leak(llm)


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill(tiny_model, parity_record, make_llm, name):
    model = tiny_model(name)
    llm = make_llm(str(model.path), skip_tokenizer_init=True, max_model_len=256, max_num_batched_tokens=16)
    run_and_compare(llm, model, make_prompts(model.vocab_size, seed=3), parity_record)
    assert_no_leak(llm)


@pytest.mark.parametrize("name", MODELS)
def test_preemption_with_tiny_kv_cache(tiny_model, parity_record, make_llm, name):
    model = tiny_model(name)
    # 12 blocks of 8 tokens: one sequence of max_model_len fits, the batch (about 50 blocks) does not.
    llm = make_llm(
        str(model.path), skip_tokenizer_init=True, max_model_len=96, block_size=8, num_gpu_blocks_override=12
    )
    run_and_compare(llm, model, make_prompts(model.vocab_size, seed=4), parity_record)
    assert llm.get_scheduler_stats().num_preemptions > 0
    assert_no_leak(llm)


# --- bfloat16 -----------------------------------------------------------------------------------
# Ours in bfloat16 (dtype="bfloat16", the same float32 checkpoint cast at load) against transformers
# in bfloat16 (its float32 model cast with .to(bfloat16)), both measured against transformers in
# float32 on our generated tokens: the rule is tests/support/hf_reference.py's `assert_bfloat16_rule`.


@pytest.fixture(scope="module")
def hf_bfloat16():
    import copy

    import torch

    cast = {}

    def get(model):
        if model.name not in cast:
            cast[model.name] = copy.deepcopy(model.hf_model).to(torch.bfloat16)
        return cast[model.name]

    return get


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_batch_against_transformers_in_bfloat16(tiny_model, hf_bfloat16, make_llm, name):
    model = tiny_model(name)
    llm = make_llm(str(model.path), skip_tokenizer_init=True, max_model_len=256, dtype="bfloat16")
    prompts = make_prompts(model.vocab_size, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    result = compare_low_precision(prompts, [o.outputs[0] for o in outputs], model.hf_model, hf_bfloat16(model))
    print(f"bfloat16 {name}: {result}")
    assert_bfloat16_rule(result)
    assert_no_leak(llm)
