"""Multi-LoRA parity: random PEFT adapters on the tiny Llama, Qwen2 and Qwen3 give, greedy and in float32, the
tokens transformers+peft gives with the same adapter, all in one mixed batch (4 adapters of several ranks and
target sets, rslora among them, plus the base model), with prefix-cache hits, chunked prefill, preemption and
more adapters than slots (max_loras=2 of 4, so the scheduler holds some back and the pool evicts)."""

from __future__ import annotations

import pytest

from asyncengine import SamplingParams
from asyncengine.interfaces.lora_resolver import LoRARequest
from support.hf_reference import compare_greedy, hf_greedy
from support.lora_adapters import TINY_LLAMA_SHAPES, make_adapter, write_adapter

pytestmark = pytest.mark.timeout(300)

# name, rank, target modules, rslora: ranks and target sets vary; every projection is covered somewhere.
ADAPTERS = [
    ("attn-r4", 4, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    ("mlp-r8", 8, ["gate_proj", "up_proj", "down_proj"], False),
    ("all-r2-rslora", 2, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    ("kv-down-r6", 6, ["k_proj", "v_proj", "down_proj"], False),
]
NUM_TOKENS = 10
PREEMPTING_TOKENS = 16  # past the third block of a 35-token prompt
SHARED_PREFIX = list(range(40, 72))  # two full blocks of 16: a prefix hit for requests of the same adapter


def _prompts(vocab: int) -> list[list[int]]:
    return [SHARED_PREFIX + [(7 * i + 3) % vocab, (11 * i + 5) % vocab, 9] for i in range(3)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def setup(request, tiny_model, peft, tmp_path_factory):
    tiny = tiny_model(request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = [make_adapter(peft, tiny.path, root / name, name=name, rank=rank, targets=targets,
                             use_rslora=rslora, seed=index + 1)
                for index, (name, rank, targets, rslora) in enumerate(ADAPTERS)]
    return tiny, adapters


def test_mixed_batch_matches_transformers_peft(setup, make_llm):
    tiny, adapters = setup
    prompts = _prompts(tiny.vocab_size)
    # Every adapter and the base model on every prompt, all submitted at once, one adapter's requests next to
    # each other so that they are in flight together and share their prefix blocks (so few blocks evict them).
    jobs = [(prompt, index) for index in [None, 0, 1, 2, 3] for prompt in prompts]
    loras = [None if index is None else LoRARequest(adapters[index].name, index + 1, str(adapters[index].path))
             for _, index in jobs]
    llm = make_llm(str(tiny.path), skip_tokenizer_init=True, dtype="float32", enable_lora=True, max_loras=2,
                   max_lora_rank=8, max_cpu_loras=2, max_model_len=64, block_size=16,
                   max_num_batched_tokens=24,  # prompts of 35 tokens prefill in chunks
                   # 35 prompt tokens and 16 new ones end in a 4th block of 16, taken while decoding: two
                   # sequences in flight need 8 blocks of these 6, whatever order the requests arrive in, so
                   # preemption happens (8 blocks let it depend on the arrival timing: once, in CI, it did not).
                   num_gpu_blocks_override=6,
                   max_num_seqs=16)
    params = SamplingParams(temperature=0, max_tokens=PREEMPTING_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in jobs], params, lora_request=loras)
    for (prompt, index), output in zip(jobs, outputs):
        model = tiny.hf_model if index is None else adapters[index].reference
        reference = hf_greedy(model, prompt, PREEMPTING_TOKENS)
        compare_greedy(output.outputs[0].token_ids, None, reference)
    stats = llm.get_scheduler_stats()
    assert stats.num_preemptions > 0, "the KV cache was meant to be too small for the batch"
    assert stats.prefix_cache_hits > 0, "requests of one adapter share a 32-token prefix"
    info = llm.collective_rpc("lora_info")[0]
    assert info["slot_loads"] > 2, "4 adapters through 2 slots must evict and reload"
    # Adapters differ from the base model and from each other (else the comparison would prove little).
    first = {index: out.outputs[0].token_ids for (prompt, index), out in zip(jobs, outputs) if prompt == prompts[0]}
    assert len({tuple(tokens) for tokens in first.values()}) == len(first)


@pytest.mark.parametrize("setup", ["llama"], indirect=True)
def test_tensor_parallel_shards_the_adapters_like_their_layers(setup, make_llm, tmp_path):
    """TP=2 (a worker process per rank): B split with a column-parallel layer's rows, A with a row-parallel
    layer's columns, the row-parallel deltas summed in the layer's own all-reduce; the same tokens as peft."""
    tiny, adapters = setup
    prompt = _prompts(tiny.vocab_size)[0]
    loras = [None] + [LoRARequest(a.name, index + 1, str(a.path)) for index, a in enumerate(adapters)]
    llm = make_llm(str(tiny.path), skip_tokenizer_init=True, dtype="float32", enable_lora=True, max_loras=4,
                   max_lora_rank=8, max_model_len=64, num_gpu_blocks_override=32, tensor_parallel_size=2,
                   lora_modules=[f"started={adapters[0].path}"])  # checked on both ranks at start-up
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * len(loras), params, lora_request=loras)
    for lora, output in zip(loras, outputs):
        model = tiny.hf_model if lora is None else adapters[lora.lora_int_id - 1].reference
        compare_greedy(output.outputs[0].token_ids, None, hf_greedy(model, prompt, NUM_TOKENS))
    assert [info["pool_bytes"] > 0 for info in llm.collective_rpc("lora_info")] == [True, True]
    # Each rank checks a loaded adapter against the checkpoint's (unsplit) shapes: the same answer from both.
    assert llm.collective_rpc("check_lora_adapter", args=["peft", str(adapters[0].path)]) == [None, None]
    wrong = write_adapter(tmp_path / "misfit", shapes=dict(TINY_LLAMA_SHAPES, o_proj=(64, 96)), targets=("o_proj",))
    refusals = llm.collective_rpc("check_lora_adapter", args=["misfit", str(wrong)])
    assert len(refusals) == 2 and refusals[0] == refusals[1], refusals
    assert "layer 0 o_proj: lora_A (4, 64) and lora_B (96, 4) do not fit" in refusals[0]["message"]


@pytest.mark.parametrize("setup", ["llama"], indirect=True)
def test_pipeline_stages_each_take_their_layers_of_the_adapters(setup, make_llm):
    """PP=2 (a stage per process, one decoder layer each): every stage checks and loads only its own layers'
    matrices of each adapter (the other stage's are not a misfit), and the tokens are peft's."""
    tiny, adapters = setup
    prompt = _prompts(tiny.vocab_size)[1]
    loras = [None] + [LoRARequest(a.name, index + 1, str(a.path)) for index, a in enumerate(adapters)]
    llm = make_llm(str(tiny.path), skip_tokenizer_init=True, dtype="float32", enable_lora=True, max_loras=4,
                   max_lora_rank=8, max_model_len=64, num_gpu_blocks_override=32, pipeline_parallel_size=2,
                   lora_modules=[f"started={adapters[2].path}"])  # every layer: checked on both stages at start-up
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * len(loras), params, lora_request=loras)
    for lora, output in zip(loras, outputs):
        model = tiny.hf_model if lora is None else adapters[lora.lora_int_id - 1].reference
        compare_greedy(output.outputs[0].token_ids, None, hf_greedy(model, prompt, NUM_TOKENS))
    assert llm.collective_rpc("check_lora_adapter", args=["all", str(adapters[2].path)]) == [None, None]
