"""The mixture-of-experts architectures of issue 35 against transformers (float32, eager attention and experts), on
tiny random models (tests/support/moe_models.py): Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GPT-OSS (its attention
sinks on the TORCH_PAGED backend's C kernel; its MXFP4 loading: test_gpt_oss_mxfp4.py).

Each decodes prompts greedily: tokens identical to transformers decoding the prompt alone (a divergence only as
a tie, tests/support/hf_reference.py) and top-5 logprobs within 1e-3. Qwen3-MoE, the representative, also runs
the paths where a batch's tokens are routed differently from a lone prompt's: chunked prefill with prefix-cache
hits, preemption under a small cache, and two tensor-parallel ranks, each holding half of every expert or, with
expert parallelism, half of the experts whole (the same tokens both ways). The rest of the matrix (each
architecture on each path, `ep2` included) is bench/model_matrix.py.
"""

from __future__ import annotations

import pytest

from support.moe_models import MOE_SPECS
from support.parity_runs import NUM_TOKENS, prompts_for, run_and_compare


@pytest.mark.parametrize("name", list(MOE_SPECS))
def test_greedy_parity_with_transformers(tiny_model, references, make_llm, parity_record, name):
    model = tiny_model(name)
    llm = make_llm(str(model.path), skip_tokenizer_init=True, max_model_len=256, dtype="float32")
    # The native class ran (not a fallback): asyncengine/models/<name>.py.
    assert llm.collective_rpc("describe")[0]["model_class"].startswith(f"asyncengine.models.{name}:")
    # Prompts past the 16-token windows (Mixtral's, GPT-OSS's sliding layers).
    run_and_compare(llm, name, prompts_for(model.vocab_size, seed=11, lengths=(3, 40, 21)), references,
                    parity_record)


def test_qwen3_moe_chunked_prefill_and_prefix_hits(tiny_model, references, make_llm, parity_record):
    model = tiny_model("qwen3_moe")
    prompts = prompts_for(model.vocab_size, seed=12, lengths=(9, 30, 1, 21), shared_prefix=40)
    llm = make_llm(str(model.path), skip_tokenizer_init=True, max_model_len=256, dtype="float32", block_size=8,
                   max_num_batched_tokens=16)
    first = run_and_compare(llm, "qwen3_moe", prompts, references, parity_record)
    second = run_and_compare(llm, "qwen3_moe", prompts, references, parity_record)
    for prompt, output in zip(prompts, second):  # every full block found, but a prompt's last token's
        assert output.num_cached_tokens == (len(prompt) // 8 - (len(prompt) % 8 == 0)) * 8
    assert sum(o.num_cached_tokens >= 40 for o in first) >= len(first) - 1  # the shared prefix, within a run


def test_qwen3_moe_preemption_under_a_small_cache(tiny_model, references, make_llm, parity_record):
    model = tiny_model("qwen3_moe")
    # 16 blocks of 8: one sequence of max_model_len (12 blocks) fits, the batch does not.
    llm = make_llm(str(model.path), skip_tokenizer_init=True, max_model_len=96, dtype="float32", block_size=8,
                   max_num_batched_tokens=32, num_gpu_blocks_override=16)
    prompts = prompts_for(model.vocab_size, seed=14, lengths=(60, 33, 47, 25, 58, 40))
    run_and_compare(llm, "qwen3_moe", prompts, references, parity_record)
    assert llm.get_scheduler_stats().num_preemptions > 0


_two_rank_tokens: dict[bool, list] = {}


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor-parallel", "expert-parallel"])
def test_qwen3_moe_on_two_tensor_parallel_ranks(tiny_model, references, make_llm, parity_record, expert_parallel):
    """Tensor parallelism (each rank half of every expert) and expert parallelism (each rank half of the experts,
    whole; tokens sent to them and back): transformers' tokens, the same in both, and every routed token
    counted once per expert it chose."""
    model = tiny_model("qwen3_moe")
    llm = make_llm(str(model.path), skip_tokenizer_init=True, max_model_len=256, dtype="float32",
                   tensor_parallel_size=2, kv_cache_memory_bytes=4 * 2**20, enable_expert_parallel=expert_parallel)
    described = llm.collective_rpc("describe")
    assert [d["rank"] for d in described] == [0, 1]
    # The experts each rank loaded and holds (8 of them): whole halves with expert parallelism.
    assert [d["local_experts"] for d in described] == (
        [[[0, 4]], [[4, 8]]] if expert_parallel else [[[0, 8]], [[0, 8]]])
    prompts = prompts_for(model.vocab_size, seed=15, lengths=(5, 50, 70))
    outputs = run_and_compare(llm, "qwen3_moe", prompts, references, parity_record)
    _two_rank_tokens[expert_parallel] = [list(o.outputs[0].token_ids) for o in outputs]
    if len(_two_rank_tokens) == 2:
        assert _two_rank_tokens[True] == _two_rank_tokens[False]
    # Tokens through the model: the prompts, then each generated token but the last; 2 sparse layers (layer 0
    # is dense) of top-2.
    forwarded = sum(len(p) for p in prompts) + (NUM_TOKENS - 1) * len(prompts)
    counts = llm.get_scheduler_stats().expert_tokens
    assert counts is not None and len(counts) == 8 and sum(counts) == forwarded * 2 * 2
    # A lone one-token request: every step has fewer tokens than ranks (rank 1's share is empty).
    run_and_compare(llm, "qwen3_moe", prompts_for(model.vocab_size, seed=16, lengths=(1,)), references, parity_record)
