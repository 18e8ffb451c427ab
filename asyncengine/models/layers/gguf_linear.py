"""`quantization="gguf"`: the linear layers run a GGUF file's quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and
the K-quants Q3_K, Q4_K, Q5_K exactly, Q6_K requantized within a stated bound: loader/gguf_kquants.py) as the file
has them, instead of the float weights the converter also writes (vLLM's name for the method).

Each layer holds `weight` (int8 `[out, in]`, the blocks' small integers), `weight_scale` and `weight_offset`
(float32 `[out, in / 32]`): the weight is `scale * q + offset` per block of 32 inputs, the file's values to
float32 rounding (the converter checks that against gguf's own dequantization). On a CPU with AVX-512 VNNI
the three are packed once for ops/cpu_block_int8.py, which quantizes the activations per block of 32 at each
call and multiplies on int8 (faster than float32 and bfloat16 matmuls on this engine's CPUs: docs/quantization.md);
elsewhere the weight is dequantized to the activation dtype on each call (the file's values, activations
unquantized). Embeddings, the lm_head and the norms are the converter's float tensors in the model dtype.

The model must be a GGUF file (or the default model): `verify_config` refuses anything else, and a GGUF file
whose linear weights include a type it cannot keep (Q2_K, an IQ type, F16), naming them. With `load_format="dummy"`
the random float weights are quantized as Q8_0 blocks (round to nearest, one scale per block), so benchmarks
and tests of random models run the same kernels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.errors import ConfigError, ModelLoadError
from asyncengine.interfaces.quantization import LinearMethod, QuantizationConfig
from asyncengine.loader.gguf_blocks import BLOCK, CONFIG_KEY, KEPT_TYPES, BlockQuantizedRows, blocks_summary
from asyncengine.ops import cpu_block_int8


def quantize_q8_0(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float rows as Q8_0 blocks: per 32 inputs `d = max|w| / 127`, `q = round(w / d)`: (q int8, d float32)."""
    n, width = rows.shape
    blocks = rows.detach().to(torch.float32).reshape(n, width // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=2) / 127.0
    q = torch.round(blocks / torch.where(scale > 0, scale, torch.ones_like(scale))[:, :, None]).clamp_(-127, 127)
    return q.to(torch.int8).reshape(n, width), scale


class GgufLinearMethod(LinearMethod):
    computed_parameters = ("weight_scale", "weight_offset")
    wants_gguf_blocks = True  # the loader hands this layer BlockQuantizedRows (loader/gguf_blocks.py)

    def create_weights(self, layer, input_size, output_size, params_dtype) -> None:
        if input_size % BLOCK:
            raise ModelLoadError(f"quantization='gguf' needs input sizes in whole blocks of {BLOCK}; this layer has "
                                 f"{input_size} inputs (with tensor parallelism: use fewer ranks)")
        blocks = input_size // BLOCK
        layer.weight = nn.Parameter(torch.zeros(output_size, input_size, dtype=torch.int8), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.zeros(output_size, blocks, dtype=torch.float32), requires_grad=False)
        layer.weight_offset = nn.Parameter(torch.zeros(output_size, blocks, dtype=torch.float32), requires_grad=False)
        layer.gguf_packed = None
        layer.gguf_compute_dtype = params_dtype

    def load_weight_rows(self, layer, row_offset, rows) -> None:
        count = rows.shape[0]
        if isinstance(rows, BlockQuantizedRows):
            q, scale, offset = rows.q, rows.scale, rows.offset
        elif isinstance(rows, torch.Tensor) and rows.is_floating_point():
            q, scale = quantize_q8_0(rows)  # the dummy loader's random weights
            offset = None
        else:
            raise ModelLoadError(f"quantization='gguf' loads a GGUF file's blocks; the loader gave this layer "
                                 f"{type(rows).__name__} instead (a plugin's load format cannot feed it)")
        layer.weight.data.narrow(0, row_offset, count).copy_(q)
        layer.weight_scale.data.narrow(0, row_offset, count).copy_(scale)
        target = layer.weight_offset.data.narrow(0, row_offset, count)
        target.zero_() if offset is None else target.copy_(offset)

    def process_weights_after_loading(self, layer) -> None:
        weight = layer.weight
        if weight.device.type != "cpu" or not cpu_block_int8.available(layer.gguf_compute_dtype):
            return
        offset = layer.weight_offset.data
        packed = cpu_block_int8.pack(weight.data, layer.weight_scale.data, offset)
        layer.gguf_packed = packed
        # The packed layout replaces the plain one in the parameters (same bytes, counted the same way).
        layer.weight.data = packed.weight
        layer.weight_scale.data = packed.scale
        layer.weight_offset.data = packed.offset if packed.offset is not None else offset.new_zeros(0)

    def apply(self, layer, x, bias=None):
        packed = layer.gguf_packed
        if packed is not None and x.dtype == layer.gguf_compute_dtype:
            rows = x.reshape(-1, x.shape[-1])
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            y = cpu_block_int8.linear(rows, packed).reshape(*x.shape[:-1], packed.n)
            return y if bias is None else y + bias
        if packed is not None:
            raise ModelLoadError(f"a quantization='gguf' layer packed for {layer.gguf_compute_dtype} activations got "
                                 f"{x.dtype} ones")
        weight = cpu_block_int8.dequantize(layer.weight, layer.weight_scale, layer.weight_offset, x.dtype)
        return F.linear(x, weight, bias)


class GgufConfig(QuantizationConfig):
    """A GGUF file's quantized linear weights, kept as they are (see the module's docstring)."""

    @classmethod
    def get_name(cls) -> str:
        return "gguf"

    @classmethod
    def verify_config(cls, engine_config: Any, hf_config: Any) -> None:
        cls._verify_tensor_parallel_parts(engine_config, hf_config)
        if getattr(engine_config, "load_format", None) == "dummy":
            return  # random weights, quantized as Q8_0 blocks as they load
        summary = blocks_summary(hf_config)
        if summary is None:
            raise ConfigError(
                f"quantization='gguf' runs a GGUF file's quantized weights, and model {engine_config.model!r} is not "
                f"a GGUF file (its config.json has no {CONFIG_KEY!r}, which the GGUF converter writes): pass a .gguf "
                "file, leave the model out for the default model, or choose int8_dynamic for float weights",
                field="quantization")
        not_kept = summary.get("not_kept") or {}
        if not_kept:
            shown = ", ".join(f"{name} ({kind})" for name, kind in list(not_kept.items())[:4])
            raise ConfigError(
                f"quantization='gguf' keeps {', '.join(KEPT_TYPES)} blocks; {summary.get('file')} has "
                f"{len(not_kept)} linear weights of other types: {shown}{' ...' if len(not_kept) > 4 else ''}. "
                "Leave quantization out (the converter's float weights) or choose int8_dynamic",
                field="quantization")

    @staticmethod
    def _verify_tensor_parallel_parts(engine_config: Any, hf_config: Any) -> None:
        """Each rank's part of a row-parallel layer (o_proj, down_proj) must hold whole blocks of 32 inputs."""
        ranks = int(getattr(engine_config, "tensor_parallel_size", 1) or 1)
        heads = getattr(hf_config, "num_attention_heads", None)
        hidden = getattr(hf_config, "hidden_size", None)
        head_dim = getattr(hf_config, "head_dim", None) or (hidden // heads if hidden and heads else None)
        widths = {"o_proj": heads * head_dim if heads and head_dim else None,
                  "down_proj": getattr(hf_config, "intermediate_size", None)}
        for name, width in widths.items():
            if width and (width % ranks or (width // ranks) % BLOCK):
                raise ConfigError(
                    f"quantization='gguf' with tensor_parallel_size={ranks}: each rank's part of {name} would hold "
                    f"{width / ranks:g} of its {width} inputs, not whole blocks of {BLOCK}; use fewer ranks",
                    field="tensor_parallel_size")

    def get_quant_method(self, layer, prefix):
        return GgufLinearMethod()


__all__ = ["GgufConfig", "GgufLinearMethod", "quantize_q8_0"]
