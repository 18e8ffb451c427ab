"""`quantization="gguf"` (models/layers/gguf_linear.py): layers built from a GGUF file's blocks compute the block
kernel's float64 reference (fused shards, a tensor-parallel rank's columns), the dequantizing path without the
kernel computes the file's weights, float rows (the dummy loader) become Q8_0 blocks, the method refuses what it
cannot run before anything starts, and the default model runs on its Q4_1 blocks."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.errors import ConfigError
from asyncengine.loader.gguf_blocks import CONFIG_KEY, BlockQuantizedRows
from asyncengine.models.layers import gguf_linear
from asyncengine.models.layers.gguf_linear import GgufConfig, quantize_q8_0
from asyncengine.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from asyncengine.interfaces.quantization import building_with, process_weights_after_loading
from asyncengine.ops import cpu_block_int8
from support.platforms import use_platform


def file_blocks(rows: int, cols: int, seed: int) -> BlockQuantizedRows:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (rows, cols), generator=generator, dtype=torch.int8)
    scale = torch.rand(rows, cols // 32, generator=generator) * 0.02
    return BlockQuantizedRows(q, scale, (torch.rand(rows, cols // 32, generator=generator) - 0.5) * 0.1, f"w{seed}")


def fused_layer(shards: list[BlockQuantizedRows]) -> MergedColumnParallelLinear:
    with building_with(GgufConfig()):
        layer = MergedColumnParallelLinear(96, [s.shape[0] for s in shards], bias=False, params_dtype=torch.float32,
                                           return_bias=False)
    for index, shard in enumerate(shards):
        layer.weight.weight_loader(layer.weight, shard, index)
    process_weights_after_loading(layer)
    return layer


@pytest.mark.skipif(not cpu_block_int8.available(torch.float32), reason="block int8 CPU kernel not built")
def test_fused_shards_compute_the_kernels_reference():
    shards = [file_blocks(64, 96, 1), file_blocks(32, 96, 2)]
    layer = fused_layer(shards)
    assert layer.gguf_packed is not None
    x = torch.randn(9, 96)
    q = torch.cat([s.q for s in shards])
    scale, offset = torch.cat([s.scale for s in shards]), torch.cat([s.offset for s in shards])
    reference = cpu_block_int8.reference_linear(x, q, scale, offset)
    ours = layer(x)
    assert bool(((ours.double() - reference).abs() <= 1e-6 * reference.abs().max()).all())


def test_without_the_kernel_the_layer_computes_the_files_weights(monkeypatch):
    monkeypatch.setattr(gguf_linear.cpu_block_int8, "available", lambda dtype: False)
    shards = [file_blocks(64, 96, 3)]
    layer = fused_layer(shards)
    assert layer.gguf_packed is None
    x = torch.randn(5, 96)
    weight = cpu_block_int8.dequantize(shards[0].q, shards[0].scale, shards[0].offset, torch.float32)
    torch.testing.assert_close(layer(x), x @ weight.t())


def test_a_row_parallel_rank_takes_its_blocks_columns(monkeypatch):
    monkeypatch.setattr(gguf_linear.cpu_block_int8, "available", lambda dtype: False)  # compare plain weights
    whole = file_blocks(48, 96, 4)
    with building_with(GgufConfig()):
        layer = RowParallelLinear(96, 48, bias=False, params_dtype=torch.float32, input_partition=(32, 96))
    layer.weight.weight_loader(layer.weight, whole)
    assert torch.equal(layer.weight, whole.q[:, 32:]) and torch.equal(layer.weight_scale, whole.scale[:, 1:])


def test_float_rows_become_q8_0_blocks():
    rows = torch.randn(8, 64) * torch.logspace(-2, 2, 8)[:, None]
    q, scale = quantize_q8_0(rows)
    restored = cpu_block_int8.dequantize(q, scale, None, torch.float32)
    assert q.abs().max() == 127
    assert bool(((restored - rows).abs() <= scale.repeat_interleave(32, dim=1) / 2 + 1e-7).all())


def test_the_method_refuses_what_it_cannot_run():
    engine = SimpleNamespace(model="some/dir", load_format="auto")
    with pytest.raises(ConfigError, match="is not a GGUF file"):
        GgufConfig.verify_config(engine, SimpleNamespace())
    k_quants = {"file": "m.gguf", "kept_types": ["Q4_K"], "not_kept": {"model.layers.0.mlp.down_proj.weight": "Q6_K"}}
    with pytest.raises(ConfigError, match=r"down_proj.weight \(Q6_K\)"):
        GgufConfig.verify_config(engine, SimpleNamespace(**{CONFIG_KEY: k_quants}))
    GgufConfig.verify_config(SimpleNamespace(model="some/dir", load_format="dummy"), SimpleNamespace())
    smollm = SimpleNamespace(hidden_size=576, num_attention_heads=9, head_dim=64, intermediate_size=1536)
    GgufConfig.verify_config(SimpleNamespace(model="m", load_format="dummy", tensor_parallel_size=3), smollm)
    with pytest.raises(ConfigError, match="o_proj would hold 144 of its 576 inputs"):  # 576 / 4: not whole blocks
        GgufConfig.verify_config(SimpleNamespace(model="m", load_format="dummy", tensor_parallel_size=4), smollm)


def test_a_float_model_is_refused_before_anything_starts(tiny_model):
    with pytest.raises(ConfigError, match="not a GGUF file"):
        LLM(str(tiny_model("llama").path), quantization="gguf", skip_tokenizer_init=True, plugins="")


def test_random_weights_run_as_q8_0_blocks(tiny_model):
    options = dict(skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=2**20, plugins="",
                   dtype="float32", load_format="dummy")
    with LLM(str(tiny_model("llama").path), quantization="gguf", **options) as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_default_model_runs_on_its_q4_1_blocks():
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The largest planet is"]
    params = SamplingParams(temperature=0.0, max_tokens=3)
    runs = {}
    for quantization, ranks in ((None, 1), ("gguf", 1), ("gguf", 2)):
        with LLM(quantization=quantization, dtype="float32", max_model_len=256, tensor_parallel_size=ranks) as llm:
            runs[quantization, ranks] = (llm.collective_rpc("describe")[0]["parameter_bytes"],
                                         [o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    (float_bytes, float_tokens), (gguf_bytes, gguf_tokens) = runs[None, 1], runs["gguf", 1]
    # Two ranks: each quantizes the activations of its own whole blocks, as one rank does; only the sums' order moves.
    assert runs["gguf", 2][1] == gguf_tokens
    # 30 layers of 3,538,944 linear weights: 1 byte each (was 4) and two float32 numbers per block of 32.
    linear = 30 * 3_538_944
    assert gguf_bytes == float_bytes - 4 * linear + linear + 8 * (linear // 32)
    # Activations quantized per block of 32 move the logits a little (bench/quantization.py: 97.6% top-1 agreement
    # with float32 over a fixed text); the first greedy token of these prompts is far from a tie.
    assert [t[0] for t in gguf_tokens] == [t[0] for t in float_tokens]


# A fixed text (the opening of the Wikipedia article "Transformer (deep learning architecture)", CC BY-SA), as
# bench/quantization.py measures it.
TEXT = ("A transformer is a deep learning architecture that was developed by researchers at Google and is based on "
        "the multi-head attention mechanism, which was proposed in the 2017 paper \"Attention Is All You Need\". "
        "Text is converted to numerical representations called tokens, and each token is converted into a vector "
        "via lookup from a word embedding table. At each layer, each token is then contextualized within the scope "
        "of the context window with other (unmasked) tokens via a parallel multi-head attention mechanism.")


@pytest.fixture
def cpu_platform(monkeypatch):
    """The CPU platform as if resolved at start-up (as tests/worker/conftest.py sets it for a bare model runner)."""
    from asyncengine.models.layers import op_registry
    from asyncengine.plugin_runtime import platform_resolution as resolution
    from asyncengine.platforms.cpu import CpuPlatform

    use_platform(monkeypatch, CpuPlatform)
    monkeypatch.setattr(op_registry, "_chains", {})
    return CpuPlatform


def text_logprobs(model_dir: Path, dtype: str, quantization: str | None, token_ids: list[int], cpu_platform):
    """The model's log-probabilities over `token_ids` in one prefill (teacher forcing), through the model runner."""
    from asyncengine.config.engine import EngineConfig
    from asyncengine.config.model import build_model_config
    from asyncengine.models.layers.attention import AttentionMetadata
    from asyncengine.plugin_runtime.records import StartupTrace
    from asyncengine.worker.model_runner import ModelRunner

    config = EngineConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=512, dtype=dtype,
                          quantization=quantization, num_gpu_blocks_override=64, plugins="")
    model_config = build_model_config(config, model_dir=model_dir, default_dtype="float32", tokenizer=None)
    StartupTrace("frontend")
    runner = ModelRunner(config, model_config, torch.device("cpu"), cpu_platform)
    runner.load_model()
    runner.initialize_kv_cache(64)
    n, block = len(token_ids), config.block_size
    metadata = AttentionMetadata(torch.arange(n), None, [n], [n], torch.arange(-(-n // block)).unsqueeze(0),
                                 block_size=block)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(token_ids), torch.arange(n), metadata)
        return torch.log_softmax(runner.model.compute_logits(hidden).float(), dim=-1)[:-1]


@pytest.mark.skipif(not cpu_block_int8.available(torch.float32), reason="block int8 CPU kernel not built")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_models_blocks_stay_within_the_stated_tolerance_of_float32(default_model_dir, cpu_platform, dtype):
    """docs/quantization.md states it (bench/quantization.py, the whole text): in float32 97.6% top-1 agreement
    with the float32 model and a mean absolute logprob difference of 0.045; in bfloat16 95.6%. Held here with
    margin: at least 94% (90% in bfloat16), at most 0.08 (0.12), perplexity within 1% (2%)."""
    from transformers import AutoTokenizer

    token_ids = AutoTokenizer.from_pretrained(str(default_model_dir))(TEXT)["input_ids"]
    reference = text_logprobs(default_model_dir, "float32", None, token_ids, cpu_platform)
    ours = text_logprobs(default_model_dir, dtype, "gguf", token_ids, cpu_platform)
    targets = torch.tensor(token_ids[1:])[:, None]
    agreement = float((ours.argmax(-1) == reference.argmax(-1)).float().mean())
    difference = float((ours.gather(1, targets) - reference.gather(1, targets)).abs().mean())
    perplexity_ratio = float(torch.exp(-ours.gather(1, targets).mean() + reference.gather(1, targets).mean()))
    loose = dtype == "bfloat16"
    assert agreement >= (0.90 if loose else 0.94), agreement
    assert difference <= (0.12 if loose else 0.08), difference
    assert abs(perplexity_ratio - 1) <= (0.02 if loose else 0.01), perplexity_ratio


def test_the_one_call_decode_step_runs_the_q4_1_blocks_to_the_module_paths_tokens(caplog):
    """The default model's Q4_1 file in float32: greedy tokens through the engine with the CPU decode step
    (ops/cpu_decode_step.py's 4-bit products) equal those of the module path (`enforce_eager=True`) up to the
    first position where the module path's top two are a near tie: the products are the module path's, but
    attention's other order of sums moves an activation by a rounding, and one at a boundary of its block's
    quantization step lands on the other integer (tests/worker/test_cpu_decode.py)."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    outputs = {}
    for eager in (False, True):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="asyncengine.worker.model_runner"):
            with LLM(quantization="gguf", dtype="float32", max_model_len=256, enforce_eager=eager) as llm:
                outputs[eager] = [o.outputs[0] for o in llm.generate(prompts, params)]
        step_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU decode step:")]
        assert step_lines and ("not used" in step_lines[0]) == eager, step_lines
    for step, module in zip(outputs[False], outputs[True]):
        differ = [i for i, (a, b) in enumerate(zip(step.token_ids, module.token_ids)) if a != b]
        if differ:
            first = differ[0]
            top = sorted(module.logprobs[first].items(), key=lambda item: -item[1])
            assert first >= 8 and step.token_ids[first] == top[1][0] and top[0][1] - top[1][1] < 0.1, \
                (first, top, step.token_ids, module.token_ids)
