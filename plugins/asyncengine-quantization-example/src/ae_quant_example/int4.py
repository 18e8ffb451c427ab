"""`example_int4`: int4 weight-only quantization, per group of input columns, with a float16 scale and
minimum per group (asymmetric: the layout of GGUF's Q4_1).

Each output row of a linear weight is cut into groups of G consecutive input columns (G = 32, or the
largest of 16 and 8 that divides this rank's input width). A group is stored as its minimum m and step
s = (max - min) / 15, both float16, and each weight as the integer q in 0..15 nearest to (w - m) / s, in
a nibble, two columns per byte (column 2j in the low nibble, 2j + 1 in the high one): w ~ m + s q.
Resident per weight element: half a byte plus 4 / G bytes of scale and minimum, 0.625 bytes at G = 32
against float32's 4. Forward unpacks and rescales the weight to the activation dtype on each call (no
int4 kernels on CPU): it saves memory, not time.

It differs from the built-in `int8` (symmetric, one float32 scale per output row, a byte per element) in
the bit width, the packing, the grouping and the zero point. Importing this module imports no torch.
"""

from __future__ import annotations

from typing import Any

from asyncengine.plugins_api import ConfigError, LinearMethod, QuantizationConfig

from ae_quant_example.record import record

GROUP_SIZES = (32, 16, 8)  # preferred first
LEVELS = 15  # a nibble: 0..15


def group_size_for(width: int) -> int | None:
    """The group size for an input width, None when none of GROUP_SIZES divides it."""
    return next((size for size in GROUP_SIZES if width % size == 0), None)


def quantize_int4(weight: Any, group_size: int) -> tuple[Any, Any, Any]:
    """(packed uint8 [rows, cols / 2], float16 scales and minimums [rows, cols / group_size]) of a weight."""
    import torch

    rows, cols = weight.shape
    groups = weight.detach().to(torch.float32).reshape(rows, cols // group_size, group_size)
    # Rounded to float16 first, so that the nibbles are computed against the values that are stored.
    low = groups.amin(dim=2).to(torch.float16)
    scale = ((groups.amax(dim=2) - low.to(torch.float32)) / LEVELS).clamp(min=2.0 ** -24).to(torch.float16)
    q = torch.round((groups - low.to(torch.float32)[:, :, None]) / scale.to(torch.float32)[:, :, None])
    q = q.clamp_(0, LEVELS).reshape(rows, cols).to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale, low


def dequantize_int4(packed: Any, scale: Any, low: Any, group_size: int, dtype: Any) -> Any:
    import torch

    rows = packed.shape[0]
    values = torch.stack(((packed & 0xF), (packed >> 4)), dim=2).reshape(rows, -1, group_size).to(dtype)
    return (values * scale.to(dtype)[:, :, None] + low.to(dtype)[:, :, None]).reshape(rows, -1)


class Int4GroupLinearMethod(LinearMethod):
    """`layer.weight` uint8 [out, in / 2] (packed), `layer.weight_scale` and `layer.weight_min` float16
    [out, in / G]: Parameters without grad (so they count in the worker's parameter bytes)."""

    computed_parameters = ("weight_scale", "weight_min")

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(self, layer, input_size, output_size, params_dtype) -> None:
        import torch
        from torch import nn

        layer.weight = nn.Parameter(torch.zeros(output_size, input_size // 2, dtype=torch.uint8),
                                    requires_grad=False)
        groups = input_size // self.group_size
        layer.weight_scale = nn.Parameter(torch.zeros(output_size, groups, dtype=torch.float16), requires_grad=False)
        layer.weight_min = nn.Parameter(torch.zeros(output_size, groups, dtype=torch.float16), requires_grad=False)
        record("layer built", layer=type(layer).__name__, input_size=input_size, output_size=output_size,
               group_size=self.group_size)

    def load_weight_rows(self, layer, row_offset, rows) -> None:
        packed, scale, low = quantize_int4(rows, self.group_size)
        layer.weight.data.narrow(0, row_offset, rows.shape[0]).copy_(packed)
        layer.weight_scale.data.narrow(0, row_offset, rows.shape[0]).copy_(scale)
        layer.weight_min.data.narrow(0, row_offset, rows.shape[0]).copy_(low)

    def apply(self, layer, x, bias=None):
        import torch.nn.functional as F

        weight = dequantize_int4(layer.weight, layer.weight_scale, layer.weight_min, self.group_size, x.dtype)
        return F.linear(x, weight, bias)


def _input_widths(engine_config: Any, hf_config: Any) -> dict[str, int]:
    """The input width, on one tensor-parallel rank, of each kind of linear layer of a Llama-like model."""
    tp = engine_config.tensor_parallel_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return {"hidden_size (q/k/v and gate/up inputs)": hf_config.hidden_size,
            "attention output per rank (o_proj input)": heads * head_dim // tp,
            "intermediate_size per rank (down_proj input)": hf_config.intermediate_size // tp}


class Int4GroupConfig(QuantizationConfig):
    """Int4 weight-only for every ColumnParallelLinear / RowParallelLinear."""

    @classmethod
    def get_name(cls) -> str:
        return "example_int4"

    @classmethod
    def verify_config(cls, engine_config: Any, hf_config: Any) -> None:
        widths = _input_widths(engine_config, hf_config)
        bad = {name: width for name, width in widths.items() if group_size_for(width) is None}
        if bad:
            raise ConfigError(
                "quantization example_int4 groups each layer's input columns by 32, 16 or 8, which do not "
                f"divide {', '.join(f'{name} = {width}' for name, width in bad.items())} (with tensor_parallel_size="
                f"{engine_config.tensor_parallel_size}); use another tensor-parallel size or another method",
                field="quantization")
        record("verified", group_sizes={name: group_size_for(width) for name, width in widths.items()},
               tensor_parallel_size=engine_config.tensor_parallel_size)

    def get_quant_method(self, layer, prefix):
        width = getattr(layer, "input_size_per_partition", None)  # this rank's input columns (vLLM's name)
        size = group_size_for(width) if isinstance(width, int) else None
        if size is None:  # verify_config refuses such models; a layer of another shape stays float
            return None
        return Int4GroupLinearMethod(size)
