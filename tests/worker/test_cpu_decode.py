"""asyncengine/worker/cpu_decode.py and its kernel, ops/cpu_decode_step.py, against its reference: the model's own modules.

A tiny random Llama (GQA 3:1, untied head), Qwen2 (q/k/v biases) and Qwen3 (q/k head norms) in a ModelRunner; its KV cache filled with random keys and values,
so each sequence attends over a context of its own length; then one decode step of 1, 3 and 8 sequences run
both ways on the same inputs: the final hidden states, the keys and values each stored, and the greedy tokens
must agree (float32 to float32's rounding, bfloat16 to bfloat16's). Also: what the step refuses, with its reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncengine import EngineConfig
from asyncengine.config.model import build_model_config
from asyncengine.ops import cpu_decode_step
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.plugin_runtime.records import StartupTrace
from asyncengine.wire.engine_core import SamplingOptions
from asyncengine.wire.worker import NewRequestData, SchedulerOutput
from asyncengine.worker.cpu_decode import why_not
from asyncengine.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not cpu_decode_step.available(torch.float32),
                                reason=f"no C compiler: {cpu_decode_step.unavailable_reason()}")

CONTEXTS = (1, 17, 40, 5, 33, 64, 2, 29)  # each sequence's context with the decoded token
BLOCK_SIZE = 16


def _runner(path: str, dtype: str, **options) -> ModelRunner:
    config = EngineConfig(model=path, dtype=dtype, skip_tokenizer_init=True, max_model_len=128,
                          num_gpu_blocks_override=64, block_size=BLOCK_SIZE, max_num_seqs=8, plugins="", **options)
    model_config = build_model_config(config, model_dir=Path(path), default_dtype="float32", tokenizer=None)
    StartupTrace("frontend")
    runner = ModelRunner(config, model_config, torch.device("cpu"), CpuPlatform)
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


@pytest.fixture(scope="module")
def platform():
    """The CPU platform as if resolved at start-up (tests/worker/conftest.py's cpu_platform), for the module."""
    from asyncengine.models.layers import op_registry
    from support.platforms import use_platform

    with pytest.MonkeyPatch.context() as patch:
        use_platform(patch, CpuPlatform)
        patch.setattr(op_registry, "_chains", {})
        yield


@pytest.fixture(scope="module")
def runners(tiny_model, platform):
    runners = {}
    for architecture in ("llama", "qwen2", "qwen3"):
        path = str(tiny_model(architecture).path)
        runners.update({(architecture, dtype): _runner(path, dtype) for dtype in ("float32", "bfloat16")})
        if cpu_decode_step.blocks_available(torch.float32):
            runners.update({(f"{architecture}-gguf", dtype): _gguf_runner(path, dtype)
                            for dtype in ("float32", "bfloat16")})
    return runners


def _gguf_runner(path: str, dtype: str) -> ModelRunner:
    """`quantization="gguf"` on random weights (Q8_0 blocks), the first layer's then replaced by Q4_1-like ones
    (4-bit integers, a scale and an offset per block of 32, as the loader keeps a Q4_1 file): the step runs
    both its 8-bit and its 4-bit products; the module path reads the same blocks."""
    from asyncengine.ops import cpu_block_int8

    runner = _runner(path, dtype, quantization="gguf", load_format="dummy")
    generator = torch.Generator().manual_seed(36)
    for layer in runner.model.model.layers[:1]:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            rows, width = linear.gguf_packed.n, linear.gguf_packed.width
            q = torch.randint(-8, 8, (rows, width), generator=generator, dtype=torch.int8)
            scale = torch.rand(rows, width // 32, generator=generator) * 0.05
            offset = (torch.rand(rows, width // 32, generator=generator) - 0.5) * 0.1
            linear.gguf_packed = cpu_block_int8.pack(q, scale, offset)
    return runner


CASES = [("llama", n) for n in (1, 3, 8)] + [("qwen2", 3), ("qwen3", 1), ("qwen3", 8)] + \
    ([("llama-gguf", 1), ("llama-gguf", 8), ("qwen2-gguf", 3), ("qwen3-gguf", 7)]
     if cpu_decode_step.blocks_available(torch.float32) else [])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("architecture", "num_seqs"), CASES)
def test_decode_step_matches_the_models_modules(runners, architecture, dtype, num_seqs):
    runner = runners[architecture, dtype]
    assert runner.cpu_decode is not None, [r.reason for r in runner.kv_cache_records]
    generator = torch.Generator().manual_seed(num_seqs)
    for key_cache, value_cache in runner.kv_caches:
        key_cache.copy_(torch.randn(key_cache.shape, generator=generator))
        value_cache.copy_(torch.randn(value_cache.shape, generator=generator))
    new, next_block = [], 0
    for index, context in enumerate(CONTEXTS[:num_seqs]):
        blocks = list(range(next_block, next_block + -(-context // BLOCK_SIZE)))
        next_block += len(blocks) + 1  # a gap, so that no two sequences' tables look alike
        prompt = torch.randint(3, 997, (context,), generator=generator).tolist()
        new.append(NewRequestData(request_id=f"{architecture}-{dtype}-{num_seqs}-{index}", prompt_token_ids=prompt,
                                  output_token_ids=[], sampling=SamplingOptions(temperature=0.0), block_ids=blocks,
                                  num_computed_tokens=context - 1))
    runner._update_states(SchedulerOutput(new_requests=new))
    inputs = runner._prepare_inputs({request.request_id: 1 for request in new})
    assert runner.cpu_decode.applies(inputs.metadata)
    slots = inputs.metadata.slot_mapping
    with torch.inference_mode():
        expected = runner.model(inputs.input_ids, inputs.positions, inputs.metadata)
        expected_kv = [(k.flatten(1, 2)[:, slots].clone(), v.flatten(1, 2)[:, slots].clone()) for k, v in runner.kv_caches]
        for key_cache, value_cache in runner.kv_caches:  # the kernel must store them itself
            key_cache.flatten(1, 2)[:, slots] = 0
            value_cache.flatten(1, 2)[:, slots] = 0
        got, got_logits = runner.cpu_decode.run(inputs.input_ids, inputs.positions, inputs.metadata)
        expected_logits = runner.model.compute_logits(expected)
        expected_tokens = expected_logits.argmax(-1)
    assert got_logits is not None  # the kernel ran the LM head too
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=0.1, rtol=0.05)
    if architecture.endswith("-gguf"):
        # The block products are the module path's arithmetic, but their activations are quantized per block:
        # where the step's input to one differs from the module path's by a rounding (attention's sums run in
        # another order), a value at a rounding boundary of x / dx can land on the other integer, moving that
        # product's outputs by dx * w (about 1e-2 here), and every later value of that row. So: most rows within
        # the float tolerance throughout, every row within a few such steps.
        for values, reference in ((got, expected), (got_logits, expected_logits)):
            rows_close = torch.isclose(values.float(), reference.float(), **tolerance).all(dim=-1)
            assert rows_close.float().mean() >= 0.5, rows_close
        tolerance = dict(atol=0.05, rtol=0.01) if dtype == "float32" else dict(atol=0.15, rtol=0.05)
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)
    torch.testing.assert_close(got_logits.float(), expected_logits.float(), **tolerance)
    for (key, value), (key_cache, value_cache) in zip(expected_kv, runner.kv_caches):
        torch.testing.assert_close(key_cache.flatten(1, 2)[:, slots].float(), key.float(), **tolerance)
        torch.testing.assert_close(value_cache.flatten(1, 2)[:, slots].float(), value.float(), **tolerance)
    # Greedy tokens equal, unless the reference's top two are within the dtype's rounding (a tie).
    top2 = got_logits.float().topk(2, dim=-1)
    tie = (top2.values[:, 0] - top2.values[:, 1]) <= tolerance["atol"]
    assert ((got_logits.argmax(-1) == expected_tokens) | tie).all()
    for request in new:
        runner._remove_request(request.request_id)


def test_decode_step_refuses_what_it_does_not_compute(tiny_model, platform):
    llama = _runner(str(tiny_model("llama").path), "float32", enforce_eager=True)
    assert llama.cpu_decode is None
    assert why_not(llama.model, llama.attention_layers, torch.float32, llama.engine_config) == "enforce_eager"
    llama.engine_config.enforce_eager = False
    assert why_not(llama.model, llama.attention_layers, torch.float32, llama.engine_config) is None
    o_proj = llama.model.model.layers[1].self_attn.o_proj  # a bias the kernel does not add
    o_proj.bias = torch.nn.Parameter(torch.zeros(o_proj.weight.shape[0]))
    assert why_not(llama.model, llama.attention_layers, torch.float32, llama.engine_config) \
        == "biases on the o, gate-up or down projections"


def test_decode_step_refuses_more_rows_than_it_holds(runners):
    weights = runners["llama", "float32"].cpu_decode._table()
    ids = torch.zeros(cpu_decode_step.MAX_ROWS + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="1 to 8 sequences"):
        cpu_decode_step.decode_step(weights, ids, torch.empty(0), torch.empty(0), ids, ids.view(-1, 1),
                                    torch.zeros(ids.numel(), dtype=torch.int32))
