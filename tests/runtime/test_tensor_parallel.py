"""Tensor parallelism over 2 ranks (mp workers, gloo on CPU): greedy outputs equal TP=1's and transformers'.

Both TP=1 and TP=2 are compared with transformers decoding each prompt alone (compare_greedy: a
divergence is accepted only where transformers' top-2 logits tie), and with each other up to the
first such tie. `collective_rpc("describe")` shows two ranks in two processes, each holding a shard
of the weights. The default model (SmolLM2-135M: 9 query heads, 3 KV heads) splits unevenly over 2 ranks.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from asyncengine import SamplingParams
from support.engine_checks import assert_all_blocks_free
from support.hf_reference import compare_greedy, hf_greedy

NUM_TOKENS = 24
OPTIONS = dict(skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=8 * 2**20)


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() < deadline, f"worker processes {pids} still exist {timeout} s after close()"
        time.sleep(0.05)


def check_two_ranks(described: list[dict]) -> list[int]:
    """Two ranks, each in its own process (a child of this one: the engine core runs in-process)."""
    assert [d["rank"] for d in described] == [0, 1]
    assert {d["world_size"] for d in described} == {2}
    pids = [d["pid"] for d in described]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert all(parent_pid(pid) == os.getpid() for pid in pids)
    return pids


def record(parity_record, comparison) -> None:
    parity_record["sequences"] += 1
    parity_record["tokens"] += comparison.num_compared
    parity_record["ties"] += int(comparison.tie)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_tp2_equals_tp1_on_tiny_models(tiny_model, make_llm, parity_record, name):
    model = tiny_model(name)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, model.vocab_size) for _ in range(n)] for n in (1, 9, 33, 70, 17)]
    references = [hf_greedy(model.hf_model, p, NUM_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)

    runs, described = {}, {}
    for tp in (1, 2):
        llm = make_llm(str(model.path), tensor_parallel_size=tp, **OPTIONS)
        described[tp] = llm.collective_rpc("describe")
        if tp == 2:
            worker_pids = check_two_ranks(described[2])
        runs[tp] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        assert_all_blocks_free(llm.get_scheduler_stats())
        llm.close()

    wait_gone(worker_pids)  # close() stopped the worker processes
    # Each rank holds a shard of the weights (not a replica), and together they hold all of them.
    full = described[1][0]["parameter_bytes"]
    assert all(d["parameter_bytes"] < 0.75 * full for d in described[2]), (full, described[2])
    assert sum(d["parameter_bytes"] for d in described[2]) >= full

    for index, reference in enumerate(references):
        tp1, tp2 = runs[1][index], runs[2][index]
        assert len(tp1.token_ids) == len(tp2.token_ids) == NUM_TOKENS
        first = compare_greedy(tp1.token_ids, tp1.logprobs, reference)
        second = compare_greedy(tp2.token_ids, tp2.logprobs, reference)
        record(parity_record, second)
        assert first.max_logprob_error < 1e-3 and second.max_logprob_error < 1e-3, (first, second)
        agree = min(first.num_compared, second.num_compared)
        assert tp1.token_ids[:agree] == tp2.token_ids[:agree]
        if not (first.tie or second.tie):
            assert tp1.token_ids == tp2.token_ids


QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence why the sky is blue.",
]


@pytest.mark.slow
def test_tp2_default_model_with_uneven_heads(default_model_dir, hf_default_model, make_llm, parity_record):
    config = json.loads((default_model_dir / "config.json").read_text())
    # The premise: neither head count divides evenly over 2 ranks.
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)

    model, tokenizer = hf_default_model
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    references = [hf_greedy(model, p, NUM_TOKENS) for p in prompts]

    llm = make_llm(str(default_model_dir), tensor_parallel_size=2, kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
    described = llm.collective_rpc("describe")
    check_two_ranks(described)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for output, reference in zip(outputs, references):
        completion = output.outputs[0]
        assert len(completion.token_ids) == NUM_TOKENS
        comparison = compare_greedy(completion.token_ids, completion.logprobs, reference)
        record(parity_record, comparison)
        assert comparison.max_logprob_error < 1e-3, comparison
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert "Paris" in outputs[0].outputs[0].text
    assert_all_blocks_free(llm.get_scheduler_stats())
