"""Quantization methods (R4): the built-in int8 weight-only method (unit and engine level, tensor
parallel included), the registry and its name check, and a plugin's method used in the worker process."""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from asyncengine import SamplingParams
from asyncengine.errors import ConfigError
from asyncengine.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from asyncengine.models.layers.quantization import (
    Int8Config,
    Int8LinearMethod,
    UnquantizedLinearMethod,
    dequantize_int8,
    quantize_int8,
    register_quantization_config,
)
from asyncengine.interfaces.quantization import QuantizationConfig, QuantizationRegistry, building_with
from asyncengine.interfaces.registry import RegistrationError

OPTIONS = dict(skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20)
NUM_TOKENS = 12


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


# -- unit ------------------------------------------------------------------------------------------------


def test_int8_round_trip_is_within_half_a_step_per_row():
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3.0, 64)[:, None]
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (64,)
    assert int(q.abs().max()) == 127  # each row's largest value uses the full range
    error = (dequantize_int8(q, scale, torch.float32) - weight).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-7).all())
    assert relative_error(dequantize_int8(q, scale, torch.float32), weight) < 1e-2


def test_an_all_zero_row_stays_zero():
    q, scale = quantize_int8(torch.zeros(3, 8))
    assert bool((dequantize_int8(q, scale, torch.float32) == 0).all())


def build(cls, *args, quantized: bool, **kwargs):
    with building_with(Int8Config() if quantized else None):
        return cls(*args, **kwargs)


def test_column_parallel_int8_output_is_close_to_float_and_holds_int8():
    gen = torch.Generator().manual_seed(1)
    shards = [torch.randn(48, 32, generator=gen) * 0.02, torch.randn(16, 32, generator=gen) * 0.02]
    biases = [torch.randn(48, generator=gen), torch.randn(16, generator=gen)]
    x = torch.randn(5, 32, generator=gen)
    layers = {}
    for quantized in (False, True):
        # Rows [8, 40) of shard 0 and [4, 12) of shard 1, as a tensor-parallel rank would hold them.
        layer = build(ColumnParallelLinear, 32, [(8, 40), (4, 12)], [48, 16], bias=True, dtype=torch.float32,
                      quantized=quantized)
        layer.load(layer.weight, shards[0], 0, "w0")
        layer.load(layer.weight, shards[1], 1, "w1")
        layer.load(layer.bias, biases[0], 0, "b0")
        layer.load(layer.bias, biases[1], 1, "b1")
        layers[quantized] = layer
    assert isinstance(layers[False].quant_method, UnquantizedLinearMethod)
    assert isinstance(layers[True].quant_method, Int8LinearMethod)
    assert layers[True].weight.dtype == torch.int8 and not layers[True].weight.requires_grad
    expected_weight = torch.cat([shards[0][8:40], shards[1][4:12]])
    assert torch.equal(layers[False].weight, expected_weight)
    assert torch.equal(layers[True].bias, torch.cat([biases[0][8:40], biases[1][4:12]]))
    reference = F.linear(x, expected_weight, layers[False].bias)
    assert relative_error(layers[True](x), reference) < 1e-2


def test_row_parallel_int8_shards_sum_to_the_float_output():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(24, 40, generator=gen) * 0.05
    x = torch.randn(7, 40, generator=gen)
    partial = []
    for start, end in ((0, 20), (20, 40)):  # two ranks' input columns (the all-reduce is the sum)
        layer = build(RowParallelLinear, (start, end), 40, 24, bias=False, dtype=torch.float32, quantized=True)
        layer.load(layer.weight, weight, None, "w")
        assert layer.weight.shape == (24, end - start) and layer.weight_scale.shape == (24,)
        partial.append(layer(x[:, start:end]))
    assert relative_error(sum(partial), x @ weight.T) < 1e-2


def test_a_wrong_checkpoint_shape_still_fails_clearly():
    from asyncengine.errors import ModelLoadError

    layer = build(RowParallelLinear, (0, 4), 8, 3, bias=False, dtype=torch.float32, quantized=True)
    with pytest.raises(ModelLoadError, match="has shape"):
        layer.load(layer.weight, torch.zeros(3, 9), None, "w")


# -- the registry ----------------------------------------------------------------------------------------


def test_int8_is_built_in_and_unknown_names_list_the_known_methods():
    assert QuantizationRegistry.owners()["int8"] == "built-in"
    assert QuantizationRegistry.load("int8") is Int8Config
    with pytest.raises(ConfigError, match=r"quantization 'awq' names no quantization method; known: .*int8"):
        QuantizationRegistry.load("awq")


def test_replacing_a_registered_method_needs_override():
    class Other(QuantizationConfig):
        pass

    with pytest.raises(RegistrationError, match="override=True"):
        register_quantization_config("int8")(Other)


def test_registering_does_not_resolve_the_platform():
    script = """
from asyncengine.plugins_api import QuantizationConfig, current_platform, register_quantization_config
from asyncengine.errors import StartupError

@register_quantization_config("mine")
class Mine(QuantizationConfig):
    pass

try:
    current_platform()
except StartupError:
    print("unresolved")
else:
    print("resolved")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "unresolved"


def test_an_unknown_quantization_fails_at_start_listing_the_known(tiny_model, make_llm):
    with pytest.raises(Exception, match=r"known: .*int8") as caught:
        make_llm(str(tiny_model("llama").path), quantization="awq", **OPTIONS)
    assert "awq" in str(caught.value)


# -- the engine ------------------------------------------------------------------------------------------


def linear_weight_shape(config) -> tuple[int, int]:
    """(elements, output rows) of the tiny Llama's ColumnParallelLinear/RowParallelLinear weights."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    rows = (q + 2 * kv) + hidden + 2 * inter + hidden
    elements = (q + 2 * kv) * hidden + hidden * q + 2 * inter * hidden + hidden * inter
    return elements * layers, rows * layers


def greedy_runs(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def compare(reference, other) -> tuple[int, int, float, float]:
    """Over the positions where both runs had the same prefix: (positions compared, top-1 agreements,
    max |logprob diff| of the reference's greedy token, the largest reference top-2 logprob gap at a
    position where the greedy tokens differ)."""
    compared = agreed = 0
    worst = worst_gap = 0.0
    for ref, out in zip(reference, other):
        for step, (ref_token, out_token) in enumerate(zip(ref.token_ids, out.token_ids)):
            compared += 1
            worst = max(worst, abs(ref.logprobs[step][ref_token] - out.logprobs[step].get(ref_token, -100.0)))
            if ref_token != out_token:
                top = sorted(ref.logprobs[step].values(), reverse=True)
                worst_gap = max(worst_gap, top[0] - top[1])
                break  # later steps see different prefixes
            agreed += 1
    return compared, agreed, worst, worst_gap


@pytest.fixture(scope="module")
def prompts(tiny_model):
    rng = random.Random(11)
    vocab = tiny_model("llama").vocab_size
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 9, 17, 33, 70)]


@pytest.fixture(scope="module")
def float_run(tiny_model, prompts):
    from asyncengine import LLM

    with LLM(str(tiny_model("llama").path), **OPTIONS) as llm:
        return llm.collective_rpc("describe")[0]["parameter_bytes"], greedy_runs(llm, prompts)


@pytest.fixture(scope="module")
def fake_quantized_references(tiny_model, prompts):
    """transformers' greedy run with every linear weight but lm_head replaced by its int8 round trip."""
    from support.hf_reference import hf_greedy

    model = copy.deepcopy(tiny_model("llama").hf_model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
                module.weight.copy_(dequantize_int8(*quantize_int8(module.weight), torch.float32))
    return [hf_greedy(model, p, NUM_TOKENS) for p in prompts]


def check_against_references(runs, references) -> None:
    from support.hf_reference import compare_greedy

    for run, reference in zip(runs, references):
        result = compare_greedy(run.token_ids, run.logprobs, reference)
        assert result.max_logprob_error < 1e-3, f"top-5 logprobs differ by {result.max_logprob_error}"


def check_close_to_float(reference, runs) -> None:
    # Measured on the tiny random Llama (logit std ~2): 36 of 41 positions agree, the greedy token's
    # logprob moves by at most ~0.31, and every divergence is at a near-tie (top-2 gap <= 0.18). That
    # is the int8 error itself: transformers with the same round-tripped weights gives the same numbers.
    compared, agreed, worst, worst_gap = compare(reference, runs)
    assert compared >= 30 and agreed >= 0.8 * compared, (agreed, compared)
    assert worst < 0.5, worst
    assert worst_gap < 0.25, worst_gap


def test_int8_llama_is_close_to_float32_with_a_quarter_of_the_linear_bytes(
    tiny_model, make_llm, prompts, float_run, fake_quantized_references
):
    model = tiny_model("llama")
    float_bytes, reference = float_run
    llm = make_llm(str(model.path), quantization="int8", **OPTIONS)
    quant_bytes = llm.collective_rpc("describe")[0]["parameter_bytes"]
    elements, rows = linear_weight_shape(model.hf_model.config)
    # Linear weights: 4 bytes each -> 1 byte each plus a float32 scale per output row; nothing else changes.
    assert quant_bytes == float_bytes - 4 * elements + elements + 4 * rows
    assert (elements + 4 * rows) / (4 * elements) < 0.27

    runs = greedy_runs(llm, prompts)
    # Exactly the int8 model: transformers with the same dequantized weights agrees to float precision.
    check_against_references(runs, fake_quantized_references)
    check_close_to_float(reference, runs)


def test_int8_with_two_tensor_parallel_ranks(tiny_model, make_llm, prompts, float_run):
    model = tiny_model("llama")
    _, reference = float_run
    llm = make_llm(str(model.path), quantization="int8", tensor_parallel_size=2, in_process=False, **OPTIONS)
    described = llm.collective_rpc("describe")
    assert [d["rank"] for d in described] == [0, 1] and len({d["pid"] for d in described}) == 2
    # (RowParallelLinear ranks scale their own input columns, so the numbers differ slightly from one rank.)
    check_close_to_float(reference, greedy_runs(llm, prompts))


def test_the_dummy_loader_quantizes_its_random_weights(tiny_model, make_llm):
    llm = make_llm(str(tiny_model("llama").path), quantization="int8", load_format="dummy", **OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids) == 4

    from asyncengine.loader.registry import DummyLoader
    from asyncengine.interfaces.model_loader import LoadConfig

    layers = {q: torch.nn.Sequential(build(ColumnParallelLinear, 16, [(0, 8)], [8], bias=True, dtype=torch.float32,
                                           quantized=q)) for q in (False, True)}
    for layer in layers.values():
        DummyLoader(LoadConfig("dummy", seed=3)).load_weights(layer, None)
    quantized, plain = layers[True][0], layers[False][0]
    assert quantized.weight.dtype == torch.int8 and int(quantized.weight.abs().max()) == 127
    assert relative_error(dequantize_int8(quantized.weight, quantized.weight_scale, torch.float32), plain.weight) < 1e-2


# -- a plugin's method -----------------------------------------------------------------------------------

SCRIPT = """
import json, os, sys
from asyncengine import LLM, SamplingParams

with LLM(sys.argv[1], in_process=False, distributed_executor_backend="mp", quantization="ae_fake_quant",
         skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20) as llm:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids
print(json.dumps({"pid": os.getpid(), "tokens": list(tokens)}))
"""


def test_a_plugin_quantization_method_builds_the_layers_in_the_worker(tiny_model, plugin_env, tmp_path, make_llm):
    model = tiny_model("llama")
    records = tmp_path / "records.jsonl"
    env = plugin_env("ae-plugin-quant", AE_PLUGIN_RECORD=str(records))
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(model.path)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    # 2 decoder layers x (qkv, o, gate_up, down), all built in the worker process, none in the frontend.
    assert len(lines) == 8 and {r["layer"] for r in lines} == {"ColumnParallelLinear", "RowParallelLinear"}
    assert {r["role"] for r in lines} == {"worker rank 0"}
    assert {r["pid"] for r in lines} != {outcome["pid"]} and len({r["pid"] for r in lines}) == 1
    # The fake method keeps float weights: the same tokens as the plain model.
    with make_llm(str(model.path), **OPTIONS) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        assert outcome["tokens"] == list(llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids)
    assert os.getpid() != outcome["pid"]
