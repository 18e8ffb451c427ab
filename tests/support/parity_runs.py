"""Greedy parity runs shared by the architecture tests (tests/models/test_native_architectures.py,
test_moe_architectures.py): random prompts, and an engine's greedy decoding of them checked against
transformers' (tests/support/hf_reference.py) with every KV block freed after."""

from __future__ import annotations

import random

from asyncengine import LLM, SamplingParams
from support.engine_checks import assert_all_blocks_free
from support.hf_reference import check_greedy

NUM_TOKENS = 24


def prompts_for(vocab_size: int, seed: int, lengths=(3, 40, 17, 64), shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def run_and_compare(llm: LLM, name: str, prompts: list[list[int]], references, parity_record) -> list:
    """`references(name, prompt)`: transformers' greedy Reference of NUM_TOKENS tokens for that prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        assert output.finished and output.outputs[0].finish_reason == "length"
        check_greedy(output.outputs[0], references(name, prompt), parity_record)
    assert_all_blocks_free(llm.get_scheduler_stats())
    return outputs
