"""Bad input gets a named error that says what was wrong, and loses nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from asyncengine import LLM, RequestError, SamplingParams, StartupError
from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import check_expert_parallel
from asyncengine.errors import ConfigError, ModelLoadError
from asyncengine.models.layers.expert_parallel import expert_ranges


@pytest.fixture
def model_copy(tiny_model, tmp_path) -> Path:
    source = tiny_model("llama").path
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target


@pytest.fixture
def tiny_llm(make_llm):
    def make(path, **options) -> LLM:
        defaults = dict(skip_tokenizer_init=True, max_model_len=64, kv_cache_memory_bytes=2**20)
        return make_llm(str(path), **{**defaults, **options})

    return make


def test_prompt_longer_than_max_model_len_then_the_engine_still_works(tiny_model, tiny_llm):
    llm = tiny_llm(tiny_model("llama").path)
    with pytest.raises(RequestError) as info:
        llm.generate({"prompt_token_ids": [5] * 64})
    assert info.value.field == "prompt" and "64" in str(info.value) and "max_model_len" in str(info.value)
    [output] = llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=3))
    assert len(output.outputs[0].token_ids) == 3


def test_generation_stops_at_max_model_len(tiny_model, tiny_llm):
    llm = tiny_llm(tiny_model("llama").path)
    [output] = llm.generate({"prompt_token_ids": [5] * 60}, SamplingParams(max_tokens=None, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 4 and output.outputs[0].finish_reason == "length"
    # An explicit max_tokens past the context is refused (docs/sampling.md, "Limits"), not shortened.
    with pytest.raises(RequestError) as info:
        llm.generate({"prompt_token_ids": [5] * 60}, SamplingParams(max_tokens=100, ignore_eos=True))
    assert info.value.field == "max_tokens"


def test_invalid_sampling_parameter_names_the_field():
    with pytest.raises(RequestError) as info:
        SamplingParams(temperature=-0.5)
    assert info.value.field == "temperature"


def test_unknown_architecture_lists_the_supported_ones(model_copy, tiny_llm):
    config = json.loads((model_copy / "config.json").read_text())
    config["architectures"] = ["FancyNetForCausalLM"]
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        tiny_llm(model_copy)
    message = str(info.value)
    assert "FancyNetForCausalLM" in message and "LlamaForCausalLM" in message and "Qwen3ForCausalLM" in message


def test_missing_weight_file(model_copy, tiny_llm):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as info:
        tiny_llm(model_copy)
    assert "no *.safetensors" in str(info.value) and str(model_copy) in str(info.value)


def test_corrupt_weight_file(model_copy, tiny_llm):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError) as info:
        tiny_llm(model_copy)
    assert str(weights) in str(info.value)


def test_weights_that_do_not_match_the_config(model_copy, tiny_llm):
    config = json.loads((model_copy / "config.json").read_text())
    config["intermediate_size"] = 96
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        tiny_llm(model_copy)
    message = str(info.value)
    assert "model.layers.0.mlp." in message and "160" in message and "do not match the config" in message


def test_missing_config_and_missing_model(tmp_path, tiny_llm):
    with pytest.raises(ModelLoadError, match="no config.json"):
        tiny_llm(tmp_path)
    with pytest.raises(ModelLoadError, match="neither a local directory nor a .gguf file"):
        tiny_llm(tmp_path / "nowhere")


def test_unusable_configuration(tiny_model, tiny_llm):
    path = tiny_model("llama").path
    with pytest.raises(ConfigError) as info:
        tiny_llm(path, block_size=0)
    assert info.value.field == "block_size"
    with pytest.raises(ConfigError, match="unknown engine option"):
        tiny_llm(path, max_num_sequences=4)
    with pytest.raises(ConfigError) as info:
        tiny_llm(path, max_model_len=100_000)
    assert info.value.field == "max_model_len" and "512" in str(info.value)
    with pytest.raises(ConfigError) as info:
        tiny_llm(path, quantization="awq")  # not a registered quantization method
    assert info.value.field == "quantization" and "known: " in str(info.value) and "int8" in str(info.value)
    with pytest.raises(ConfigError) as info:
        tiny_llm(path, worker_cls="no_colon")  # "auto" or "pkg.mod:Class" (a Worker subclass)
    assert info.value.field == "worker_cls" and "pkg.mod:Class" in str(info.value)
    with pytest.raises(ConfigError) as info:
        tiny_llm(path, worker_cls="ae_no_such_module:Worker")
    assert info.value.field == "worker_cls" and "importing 'ae_no_such_module' failed" in str(info.value)
    with pytest.raises(ConfigError) as info:
        tiny_llm(path, tensor_parallel_size=2, distributed_executor_backend="uni")
    assert info.value.field == "distributed_executor_backend"
    # Expert parallelism: over more than one rank, of a model with experts (refused before any worker starts).
    with pytest.raises(ConfigError, match="tensor_parallel_size is 1") as info:
        tiny_llm(path, enable_expert_parallel=True)
    assert info.value.field == "enable_expert_parallel"
    with pytest.raises(ConfigError, match="has no experts") as info:
        tiny_llm(path, enable_expert_parallel=True, tensor_parallel_size=2)
    assert info.value.field == "enable_expert_parallel"


def test_expert_parallelism_needs_an_expert_per_rank_and_splits_uneven_counts_as_vllm():
    config = EngineConfig(enable_expert_parallel=True, tensor_parallel_size=8)
    with pytest.raises(ConfigError, match="has 4: each rank needs at least one") as info:
        check_expert_parallel(config, ["MixtralForCausalLM"], {"num_local_experts": 4})
    assert info.value.field == "enable_expert_parallel"
    check_expert_parallel(config, ["Qwen2MoeForCausalLM"], {"num_experts": 60})  # 8 ranks of 8 or 7 experts
    assert expert_ranges(60, 8) == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 39), (39, 46), (46, 53), (53, 60)]
    with pytest.raises(ModelLoadError, match="each rank needs at least one"):
        expert_ranges(4, 8)


def test_kv_cache_too_small_for_one_sequence(tiny_model, tiny_llm):
    with pytest.raises(StartupError) as info:
        tiny_llm(tiny_model("llama").path, max_model_len=256, num_gpu_blocks_override=3)
    assert "max_model_len=256" in str(info.value)


def test_generation_config_defaults_and_eos_ids(model_copy, tiny_llm):
    # Find the token greedy decoding produces first, then declare it an EOS id of the model.
    prompt = {"prompt_token_ids": [7, 8, 9, 10]}
    [probe] = tiny_llm(model_copy).generate(prompt, SamplingParams(temperature=0, max_tokens=1))
    first = probe.outputs[0].token_ids[0]
    (model_copy / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [900, first], "do_sample": False, "max_new_tokens": 5})
    )
    llm = tiny_llm(model_copy)
    assert first in llm.engine.model_config.eos_token_ids and 900 in llm.engine.model_config.eos_token_ids
    [output] = llm.generate(prompt)  # greedy and max 5 tokens by the model's defaults
    assert output.outputs[0].token_ids == [first] and output.outputs[0].finish_reason == "stop"
    [ignored] = llm.generate(prompt, SamplingParams(ignore_eos=True))
    assert len(ignored.outputs[0].token_ids) == 5 and ignored.outputs[0].token_ids[0] == first
    # An explicit value wins over the model's default.
    [sampled] = llm.generate(prompt, SamplingParams(ignore_eos=True, max_tokens=9))
    assert len(sampled.outputs[0].token_ids) == 9
    assert llm.get_default_sampling_params().temperature == 0.0
