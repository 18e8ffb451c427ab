"""deep_int8: W8A8 in vLLM's form. A float checkpoint's weights are quantized once they are loaded (one
scale per output channel); each call quantizes the activations per token and runs an int8 x int8 -> int32
GEMM, then scales back. "deep_int8_broken" is the same config whose create_weights raises."""

import os

import torch
from torch.nn import Parameter

from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.utils import set_weight_attrs

logger = init_logger(__name__)


@register_quantization_config("deep_int8")
class DeepInt8Config(QuantizationConfig):
    def __init__(self, ignored_layers=None):
        super().__init__()
        self.ignored_layers = list(ignored_layers or [])
        self.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                       "gate_up_proj": ["gate_proj", "up_proj"]}

    def __repr__(self):
        return f"DeepInt8Config(ignored_layers={self.ignored_layers})"

    @classmethod
    def get_name(cls):
        return "deep_int8"

    def get_supported_act_dtypes(self):
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls):
        return 75

    @staticmethod
    def get_config_filenames():
        return []

    @classmethod
    def from_config(cls, config):
        return cls(ignored_layers=cls.get_from_keys_or(config, ["ignored_layers"], []))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant):
        if hf_quant_cfg.get("quant_method") == "deep_w8a8":  # this checkpoint's own spelling
            return cls.get_name()
        return None

    def get_quant_method(self, layer, prefix):
        if isinstance(layer, LinearBase):
            if prefix in self.ignored_layers:
                return UnquantizedLinearMethod()
            return DeepInt8LinearMethod(self)
        return None


class DeepInt8LinearMethod(LinearMethodBase):
    def __init__(self, quant_config):
        self.quant_config = quant_config

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        output_size_per_partition = sum(output_partition_sizes)
        weight = Parameter(torch.empty(output_size_per_partition, input_size_per_partition, dtype=params_dtype),
                           requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        weight_scale = Parameter(torch.ones(output_size_per_partition, dtype=torch.float32), requires_grad=False)
        layer.register_parameter("weight_scale", weight_scale)
        layer.logical_widths = output_partition_sizes
        layer.tp_size = get_tensor_model_parallel_world_size()

    def process_weights_after_loading(self, layer):
        weight = layer.weight.data.to(torch.float32)
        scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        quantized = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        layer.weight = Parameter(quantized, requires_grad=False)
        layer.weight_scale = Parameter(scale, requires_grad=False)
        record = os.environ.get("DEEP_RECORD")
        if record:
            with open(record, "a", encoding="utf-8") as file:
                file.write(f"quantized {type(layer).__name__} {tuple(quantized.shape)} {quantized.dtype}\n")

    def apply(self, layer, x, bias=None):
        rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
        x_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
        x_q = torch.round(rows / x_scale).clamp(-127, 127).to(torch.int8)
        accumulated = torch._int_mm(x_q, layer.weight.t())  # int8 x int8 -> int32
        out = (accumulated.to(torch.float32) * x_scale * layer.weight_scale[None, :]).to(x.dtype)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias


@register_quantization_config("deep_int8_broken")
class BrokenDeepInt8Config(DeepInt8Config):
    @classmethod
    def get_name(cls):
        return "deep_int8_broken"

    def get_quant_method(self, layer, prefix):
        if isinstance(layer, LinearBase):
            return BrokenCreateWeights(self)
        return None


class BrokenCreateWeights(DeepInt8LinearMethod):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        raise ValueError(f"deep_int8 needs input sizes divisible by 128, got {input_size_per_partition}")
