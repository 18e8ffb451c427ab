"""Pre-quantized checkpoints (config.json's `quantization_config`: gptq, awq, fp8, bitsandbytes, ...): refused at
start-up, naming the method and what to do, unless a registered QuantizationConfig loads them, by its name or by
claiming the checkpoint in `override_quantization_method` (vLLM's rule)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from asyncengine.errors import ConfigError
from asyncengine.interfaces.quantization import QuantizationConfig, QuantizationRegistry, resolve_quantization_name


def checkpoint(method: str | None, **extra) -> SimpleNamespace:
    config = dict(extra) if method is None else {"quant_method": method, **extra}
    return SimpleNamespace(quantization_config=config)


@pytest.fixture
def registry(monkeypatch):
    """The quantization table, restored after the test."""
    monkeypatch.setattr(QuantizationRegistry, "_entries", dict(QuantizationRegistry._entries))
    return QuantizationRegistry


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8", "bitsandbytes", "compressed-tensors"])
def test_a_method_nothing_registered_loads_is_refused_naming_it(method):
    with pytest.raises(ConfigError) as refused:
        resolve_quantization_name(None, checkpoint(method, bits=4))
    message = str(refused.value)
    assert f"pre-quantized with {method!r}" in message and "float (unquantized) checkpoint" in message
    assert "override_quantization_method" in message and refused.value.field == "quantization"


def test_asking_for_a_built_in_method_does_not_load_a_prequantized_checkpoint():
    with pytest.raises(ConfigError, match=r"pre-quantized with 'gptq'.*\(quantization='int8' quantizes float "
                                          r"checkpoints only\)"):
        resolve_quantization_name("int8", checkpoint("gptq"))
    with pytest.raises(ConfigError, match="pre-quantized with an unnamed method"):
        resolve_quantization_name(None, checkpoint(None, load_in_4bit=True))


def test_a_plugin_method_loads_it_by_name_or_by_claiming_it(registry):
    class Gptq(QuantizationConfig):
        @classmethod
        def get_name(cls):
            return "gptq"

    class Marlin(QuantizationConfig):
        @classmethod
        def get_name(cls):
            return "my_marlin"

        @classmethod
        def override_quantization_method(cls, hf_quant_cfg, user_quant):
            return cls.get_name() if hf_quant_cfg.get("quant_method") == "awq" and user_quant is None else None

    registry.register("gptq", Gptq, owner="tests")
    registry.register("my_marlin", Marlin, owner="tests")
    assert resolve_quantization_name(None, checkpoint("gptq")) == "gptq"
    assert resolve_quantization_name("gptq", checkpoint("gptq")) == "gptq"
    assert resolve_quantization_name(None, checkpoint("awq")) == "my_marlin"
    with pytest.raises(ConfigError, match=r"quantized with 'gptq'.*quantization='int8' was asked for"):
        resolve_quantization_name("int8", checkpoint("gptq"))
    with pytest.raises(ConfigError, match=r"pre-quantized with 'fp8'.*plugin methods registered: gptq, my_marlin"):
        resolve_quantization_name(None, checkpoint("fp8"))


def test_the_engine_refuses_it_at_start_up(tiny_model, tmp_path, make_llm):
    model = tmp_path / "gptq-llama"
    shutil.copytree(tiny_model("llama").path, model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="pre-quantized with 'gptq'"):
        make_llm(str(model), skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=2**20)
