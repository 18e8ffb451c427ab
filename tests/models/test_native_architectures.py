"""The native architectures of issue 34 against transformers (float32, eager attention), on tiny random models
(tests/support/native_models.py): Mistral, Gemma 2, Gemma 3, Phi-3, OLMo 2, Granite, GLM-4.

Each decodes prompts longer than its sliding window (where it has one) greedily: tokens identical to
transformers decoding the prompt alone (a divergence only as a tie, tests/support/hf_reference.py) and top-5
logprobs within 1e-3. Gemma 3, whose three sliding layers and one full layer make four KV cache groups, also
runs the paths that could break a sliding window: chunked prefill, prefix-cache hits, preemption under a
small cache, and two tensor-parallel ranks; and its KV usage is counted from the block manager while a prompt
four times its window decodes: each sliding layer holds its window's blocks, the full layer all of them.
The rest of the matrix (each architecture on each path) is bench/model_matrix.py.
"""

from __future__ import annotations

import anyio
import pytest

from asyncengine import SamplingParams
from asyncengine.frontend.async_engine import AsyncEngine
from support.native_models import SPECS, WINDOW
from support.parity_runs import prompts_for, run_and_compare


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_parity_with_transformers(tiny_model, references, make_llm, parity_record, name):
    model = tiny_model(name)
    llm = make_llm(str(model.path), skip_tokenizer_init=True, max_model_len=256)
    run_and_compare(llm, name, prompts_for(model.vocab_size, seed=1), references, parity_record)


# -- Gemma 3: the paths a sliding window could break ------------------------------------------------------


def test_gemma3_chunked_prefill_and_prefix_hits(tiny_model, references, make_llm, parity_record):
    model = tiny_model("gemma3")
    prompts = prompts_for(model.vocab_size, seed=2, lengths=(9, 30, 1, 21), shared_prefix=40)
    # Chunks of 16 tokens (the window): each chunk's queries reach back into the previous chunk's blocks.
    llm = make_llm(str(model.path), skip_tokenizer_init=True, max_model_len=256, block_size=8,
                   max_num_batched_tokens=16)
    first = run_and_compare(llm, "gemma3", prompts, references, parity_record)
    second = run_and_compare(llm, "gemma3", prompts, references, parity_record)
    # The second run finds every full block of each prompt (the full layer's, and the sliding layers' last
    # blocks, all that their window needs), but for a prompt of whole blocks, which recomputes its last.
    for prompt, output in zip(prompts, second):
        assert output.num_cached_tokens == (len(prompt) // 8 - (len(prompt) % 8 == 0)) * 8
    assert sum(o.num_cached_tokens >= 40 for o in first) >= len(first) - 1  # the shared prefix, within a run


def test_gemma3_preemption_under_a_small_cache(tiny_model, references, make_llm, parity_record):
    model = tiny_model("gemma3")
    # 40 blocks of 8: one sequence of max_model_len fits (12 for the full layer, 7 for each sliding one with
    # steps of 32 tokens, and the null block: 34), the batch does not.
    llm = make_llm(str(model.path), skip_tokenizer_init=True, max_model_len=96, block_size=8,
                   max_num_batched_tokens=32, num_gpu_blocks_override=40)
    prompts = prompts_for(model.vocab_size, seed=4, lengths=(60, 33, 47, 25, 58, 40))
    run_and_compare(llm, "gemma3", prompts, references, parity_record)
    assert llm.get_scheduler_stats().num_preemptions > 0


def test_gemma3_on_two_tensor_parallel_ranks(tiny_model, references, make_llm, parity_record):
    model = tiny_model("gemma3")
    llm = make_llm(str(model.path), skip_tokenizer_init=True, max_model_len=256, tensor_parallel_size=2,
                   kv_cache_memory_bytes=4 * 2**20)
    assert [d["rank"] for d in llm.collective_rpc("describe")] == [0, 1]
    run_and_compare(llm, "gemma3", prompts_for(model.vocab_size, seed=5, lengths=(5, 50, 70)), references,
                    parity_record)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_a_sliding_layers_kv_blocks_stay_at_its_window_while_a_long_prompt_decodes(tiny_model, anyio_backend):
    model = tiny_model("gemma3")
    block_size = 8
    window_blocks = -(-(WINDOW - 1) // block_size) + 1  # the blocks a query's window spans, its own included
    prompt = prompts_for(model.vocab_size, seed=6, lengths=(4 * WINDOW,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    seen = []
    async with AsyncEngine.start(model=str(model.path), skip_tokenizer_init=True, max_model_len=256,
                                 block_size=block_size, kv_cache_memory_bytes=2**21) as engine:
        length = len(prompt)
        async for output in engine.generate({"prompt_token_ids": prompt}, params):
            length += len(output.outputs[0].token_ids)
            info = await engine.call_engine_core("kv_cache_info")
            seen.append((length, info["group_blocks_in_use"]))
        with anyio.fail_after(10):
            info = await engine.call_engine_core("kv_cache_info")
    assert info["sliding_windows"] == [None, WINDOW, WINDOW, WINDOW]  # the full layer's group, then three sliding
    assert info["group_blocks_in_use"] == [0, 0, 0, 0]  # all released at the end
    decoding = seen[1:-1]  # from the second token (the prompt's step took all its blocks, for its own queries)
    assert len(decoding) > 30
    for length, (full, *sliding) in decoding:
        # The full layer holds the whole sequence (the step in flight may have taken the next block).
        assert -(-length // block_size) <= full <= -(-(length + 2) // block_size)
        assert all(count <= window_blocks for count in sliding), (length, sliding)
    assert max(full for _, (full, *_) in decoding) >= (4 * WINDOW + 30) // block_size  # it grew: the window did not
