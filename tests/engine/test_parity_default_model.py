"""Greedy parity of the default model (SmolLM2-135M-Instruct) with transformers loading the same GGUF file.

The same checks as test_parity_tiny.py, on the real model: a batch of 8 prompts of mixed lengths
(chat-templated and raw text), 32 greedy tokens each, top-5 logprobs within 1e-3, through the
plain path, prefix-cache hits, chunked prefill and forced preemption.
"""

from __future__ import annotations

import pytest

from asyncengine import LLM, SamplingParams
from support.engine_checks import assert_all_blocks_free
from support.hf_reference import assert_bfloat16_rule, compare_greedy, compare_low_precision, hf_greedy

pytestmark = pytest.mark.slow

NUM_TOKENS = 32
QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence why the sky is blue.",
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker who",
    "1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="module")
def prompts(hf_default_model) -> list[list[int]]:
    _, tokenizer = hf_default_model
    chat = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    encoded = [tokenizer.encode(text, add_special_tokens=False) for text in chat]
    encoded += [tokenizer.encode(text) for text in RAW]
    return encoded


@pytest.fixture(scope="module")
def references(hf_default_model, prompts):
    model, _ = hf_default_model
    return [hf_greedy(model, prompt, NUM_TOKENS) for prompt in prompts]


def check(llm: LLM, prompts, references, parity_record) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for output, reference in zip(outputs, references):
        completion = output.outputs[0]
        result = compare_greedy(completion.token_ids, completion.logprobs, reference)
        assert result.max_logprob_error < 1e-3, f"top-5 logprobs differ by {result.max_logprob_error}"
        parity_record["sequences"] += 1
        parity_record["tokens"] += result.num_compared
        parity_record["ties"] += int(result.tie)
    assert_all_blocks_free(llm.get_scheduler_stats())
    return outputs


def test_batch(default_model_dir, prompts, references, parity_record, make_llm):
    llm = make_llm(str(default_model_dir), kv_cache_memory_bytes=256 * 2**20, max_model_len=1024)
    outputs = check(llm, prompts, references, parity_record)
    # Text is the detokenized token ids.
    tokenizer = llm.get_tokenizer()
    assert outputs[0].outputs[0].text == tokenizer.decode(outputs[0].outputs[0].token_ids, skip_special_tokens=True)
    assert "Paris" in outputs[0].outputs[0].text
    # Prefix caching: the same batch again finds its prompts in the cache, with the same outputs.
    again = check(llm, prompts, references, parity_record)
    assert all(o.num_cached_tokens >= 16 for o in again if len(o.prompt_token_ids) > 16)


def test_chunked_prefill(default_model_dir, prompts, references, parity_record, make_llm):
    llm = make_llm(str(default_model_dir), kv_cache_memory_bytes=256 * 2**20, max_model_len=1024, max_num_batched_tokens=24)
    check(llm, prompts, references, parity_record)


def test_preemption(default_model_dir, prompts, references, parity_record, make_llm):
    # 20 blocks of 16 tokens; the batch needs about 45.
    llm = make_llm(str(default_model_dir), max_model_len=320, num_gpu_blocks_override=20)
    check(llm, prompts, references, parity_record)
    assert llm.get_scheduler_stats().num_preemptions > 0


def test_bfloat16_against_transformers_in_bfloat16(default_model_dir, hf_default_model, prompts, make_llm):
    """The bfloat16 rule (support/hf_reference.py) on the real model: ours in bfloat16 is no further from
    transformers' float32 than transformers' own bfloat16 is (top-5 logprobs, greedy agreement)."""
    import copy

    import torch

    model, _ = hf_default_model
    llm = make_llm(str(default_model_dir), kv_cache_memory_bytes=128 * 2**20, max_model_len=1024, dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    result = compare_low_precision(prompts, [o.outputs[0] for o in outputs], model,
                                   copy.deepcopy(model).to(torch.bfloat16))
    print(f"bfloat16 default model: {result}")
    assert_bfloat16_rule(result)
    assert "Paris" in outputs[0].outputs[0].text
