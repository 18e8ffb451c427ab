"""vLLM's quantization contract in-process, without an engine: how the worker builds a vLLM-shaped
QuantizationConfig (from_config with the checkpoint's quantization config or the method's config file), how
our linear layers run a vLLM LinearMethodBase (vLLM's create_weights arguments, apply, the weights quantized
after loading), and how a method's failures are named. (The engine runs: test_vllm_shaped_deep.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn import Parameter

from asyncengine.errors import ModelLoadError
from asyncengine.interfaces.plugin_code import PluginCodeError
from asyncengine.interfaces.quantization import (
    LinearBase,
    LinearMethodBase,
    QuantizationConfig,
    building_with,
    process_weights_after_loading,
    quantization_config_for,
)
from asyncengine.models.layers.linear import QKVParallelLinear, RowParallelLinear
from asyncengine.models.layers.linear import set_weight_attrs


class Recording(LinearMethodBase):
    """Keeps the arguments of create_weights; float weights, rounded to 1/8 after loading."""

    def __init__(self):
        self.created = None

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        self.created = (input_size_per_partition, list(output_partition_sizes), input_size, output_size,
                        params_dtype, sorted(extra_weight_attrs))
        weight = Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                           requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})  # as vLLM's methods mark their weight
        set_weight_attrs(weight, extra_weight_attrs)
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_step", Parameter(torch.zeros(()), requires_grad=False))

    def process_weights_after_loading(self, layer):
        layer.weight_step.data.fill_(0.125)
        layer.weight.data = torch.round(layer.weight.data / 0.125) * 0.125

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


class RecordingConfig(QuantizationConfig):
    def __init__(self, bits=8):
        super().__init__()
        self.bits = bits
        self.methods = []

    @classmethod
    def get_name(cls):
        return "recording"

    @staticmethod
    def get_config_filenames():
        return ["recording_config.json"]

    @classmethod
    def from_config(cls, config):
        return cls(bits=cls.get_from_keys(config, ["bits", "w_bits"]))

    def get_quant_method(self, layer, prefix):
        if not isinstance(layer, LinearBase):
            return None
        self.methods.append(Recording())
        return self.methods[-1]


def test_from_config_gets_the_checkpoints_quantization_config_or_the_methods_file(tmp_path):
    hf_config = SimpleNamespace(quantization_config={"quant_method": "recording", "w_bits": 4})
    assert quantization_config_for(RecordingConfig, hf_config, tmp_path).bits == 4
    (tmp_path / "recording_config.json").write_text(json.dumps({"bits": 3}))
    assert quantization_config_for(RecordingConfig, SimpleNamespace(), tmp_path).bits == 3
    (tmp_path / "recording_config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"reads its config from one of \['recording_config.json'\]"):
        quantization_config_for(RecordingConfig, SimpleNamespace(), tmp_path)


def test_a_vllm_linear_method_builds_loads_and_runs_in_our_linear_layers():
    torch.manual_seed(0)
    config = RecordingConfig()
    with building_with(config):
        # q, k, v fused: 2 query heads and 1 KV head of 4, shards of 8, 4 and 4 rows, 16 inputs (one rank)
        qkv = QKVParallelLinear(16, 4, 2, 1, bias=True, params_dtype=torch.float32, return_bias=False)
        down = RowParallelLinear(16, 8, bias=False, params_dtype=torch.float32)
    assert config.methods[0].created == (16, [8, 4, 4], 16, 16, torch.float32, ["weight_loader"])
    assert config.methods[1].created == (16, [8], 16, 8, torch.float32, ["weight_loader"])
    # the parameters the method adds are computed, not read from the checkpoint
    assert qkv.quant_method.computed_parameters == ("weight_step",)
    assert qkv.weight.weight_loader == qkv.weight_loader and (qkv.weight.output_dim, qkv.weight.input_dim) == (0, 1)
    assert down.weight.weight_loader == down.weight_loader
    parts = [torch.randn(8, 16), torch.randn(4, 16), torch.randn(4, 16)]
    for shard_id, part in zip("qkv", parts):
        qkv.weight.weight_loader(qkv.weight, part, shard_id)
    qkv.bias.data.zero_()
    process_weights_after_loading(qkv)
    x = torch.randn(3, 16)
    expected = F.linear(x, torch.round(torch.cat(parts) / 0.125) * 0.125)
    torch.testing.assert_close(qkv(x), expected)
    assert float(qkv.weight_step) == 0.125


class WrongShape(Recording):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, *args, **kwargs):
        layer.register_parameter("weight", Parameter(torch.empty(input_size_per_partition, 1), requires_grad=False))


class Raising(Recording):
    def apply(self, layer, x, bias=None):
        raise RuntimeError("the kernel is missing")


@pytest.mark.parametrize("method, error, message", [
    (WrongShape, ModelLoadError, "create_weights registered layer.weight with shape (16, 1); this engine fills a "
                                 "weight shaped (8, 16)"),
    (Raising, PluginCodeError, "Raising (no installed distribution): its hook apply raised RuntimeError: the "
                               "kernel is missing (in the "),
])
def test_a_methods_failure_is_named(method, error, message):
    config = RecordingConfig()
    config.get_quant_method = lambda layer, prefix: method()
    with pytest.raises(error) as raised:
        with building_with(config):
            layer = RowParallelLinear(16, 8, bias=False, params_dtype=torch.float32)
        layer(torch.randn(2, 16))
    assert message in str(raised.value)


def test_quantization_config_has_vllms_defaults():
    config = QuantizationConfig.from_config({})
    assert config.packed_modules_mapping == {} and config.get_min_capability() == 0
    assert config.get_config_filenames() == [] and config.get_cache_scale("x") is None
    assert QuantizationConfig.override_quantization_method({"quant_method": "x"}, None) is None
    assert torch.bfloat16 in config.get_supported_act_dtypes()
    assert QuantizationConfig.get_from_keys_or({"a": 1}, ["b", "a"], 0) == 1
    assert QuantizationConfig.get_from_keys_or({}, ["b"], 7) == 7
