"""Pipeline parallelism (mp workers, gloo on CPU): PP=2 and TP=2 x PP=2 give TP=1's greedy outputs.

Each run is compared with transformers decoding each prompt alone (compare_greedy: a divergence is
accepted only where transformers' top-2 logits tie) and with TP=1 up to the first such tie, as the
tensor-parallel parity tests do. `collective_rpc("describe")` shows the ranks, each holding a part of
the weights. The uneven case is a 3-layer Qwen2 with tied embeddings over 2 stages: 2 layers and the
embedding on the first, 1 layer, the norm and the head (loaded from the embedding's tensor) on the last.
The Llama runs have two micro-batches in flight (the default), and the engine core sends the sampled
tokens to the first stage (engine_core/micro_batches.py); the Qwen2 run has them off
(ASYNCENGINE_PIPELINE_MICRO_BATCHES=0), where the last stage broadcasts them.
"""

from __future__ import annotations

import random

import pytest

from asyncengine import SamplingParams
from asyncengine.errors import ConfigError
from asyncengine import parallel_state
from asyncengine.parallel_state import split_evenly
from support.engine_checks import assert_all_blocks_free
from support.hf_reference import compare_greedy, hf_greedy
from support.tiny_models import SPECS, build_tiny_model

NUM_TOKENS = 12
OPTIONS = dict(skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=8 * 2**20)
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)


def prompts_for(vocab_size: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (1, 21, 70)]


def run(make_llm, path, prompts, **parallel):
    llm = make_llm(str(path), **parallel, **OPTIONS)
    described = llm.collective_rpc("describe")
    completions = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)]
    assert_all_blocks_free(llm.get_scheduler_stats())
    llm.close()
    return described, completions


def check_against(references, completions, baseline=None, parity_record=None):
    for index, reference in enumerate(references):
        ours = completions[index]
        comparison = compare_greedy(ours.token_ids, ours.logprobs, reference)
        if parity_record is not None:
            parity_record["sequences"] += 1
            parity_record["tokens"] += comparison.num_compared
            parity_record["ties"] += int(comparison.tie)
        assert comparison.max_logprob_error < 1e-3, comparison
        if baseline is not None:
            base = compare_greedy(baseline[index].token_ids, None, reference)
            agree = min(comparison.num_compared, base.num_compared)
            assert ours.token_ids[:agree] == baseline[index].token_ids[:agree]
            if not (comparison.tie or base.tie):
                assert ours.token_ids == baseline[index].token_ids


def test_layers_split_unevenly_earlier_stages_first():
    assert split_evenly(3, 2) == [(0, 2), (2, 3)]
    assert split_evenly(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]


def test_pp2_and_tp2_pp2_equal_tp1(tiny_model, make_llm, parity_record, monkeypatch):
    monkeypatch.delenv("ASYNCENGINE_PIPELINE_MICRO_BATCHES", raising=False)  # the default: on
    model = tiny_model("llama")
    prompts = prompts_for(model.vocab_size)
    references = [hf_greedy(model.hf_model, prompt, NUM_TOKENS) for prompt in prompts]
    _, tp1 = run(make_llm, model.path, prompts)
    described, pp2 = run(make_llm, model.path, prompts, pipeline_parallel_size=2)
    # Two stages, each a process with one of the two layers (and the embedding or the head): about half each.
    assert [d["rank"] for d in described] == [0, 1] and len({d["pid"] for d in described}) == 2
    total = sum(d["parameter_bytes"] for d in described)
    assert all(d["parameter_bytes"] < 0.7 * total for d in described), described
    check_against(references, pp2, tp1, parity_record)

    described, tp2pp2 = run(make_llm, model.path, prompts, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert [d["rank"] for d in described] == [0, 1, 2, 3] and len({d["pid"] for d in described}) == 4
    assert all(d["parameter_bytes"] < 0.4 * total for d in described), described
    check_against(references, tp2pp2, tp1, parity_record)


def test_uneven_stages_with_tied_embeddings(tmp_path_factory, make_llm, parity_record, monkeypatch):
    monkeypatch.setitem(SPECS, "qwen2-3-layers", {**SPECS["qwen2"], "num_hidden_layers": 3})
    model = build_tiny_model("qwen2-3-layers", tmp_path_factory.mktemp("qwen2-3-layers"))
    prompts = prompts_for(model.vocab_size)
    # No micro-batches: the last stage broadcasts its sampled tokens to the first.
    monkeypatch.setenv("ASYNCENGINE_PIPELINE_MICRO_BATCHES", "0")  # (read by the in-process engine core)
    _, pp2 = run(make_llm, model.path, prompts, pipeline_parallel_size=2)
    check_against([hf_greedy(model.hf_model, prompt, NUM_TOKENS) for prompt in prompts], pp2,
                  parity_record=parity_record)


def test_more_stages_than_layers_fails_naming_the_option(monkeypatch):
    # The state a worker of stage 0 of 3 has (set without a process group: stage_layers reads only this).
    monkeypatch.setattr(parallel_state, "_state", parallel_state.ParallelState(pipeline_size=3))
    assert parallel_state.stage_layers(4) == (0, 2)
    with pytest.raises(ConfigError, match="2 layers cannot be split over pipeline_parallel_size=3") as caught:
        parallel_state.stage_layers(2)
    assert caught.value.field == "pipeline_parallel_size"


def test_uni_refuses_several_stages():
    from asyncengine import EngineConfig

    with pytest.raises(ConfigError, match="pipeline_parallel_size=2 needs one process per rank"):
        EngineConfig(pipeline_parallel_size=2, distributed_executor_backend="uni")
    assert EngineConfig(pipeline_parallel_size=2).executor_backend == "mp"
