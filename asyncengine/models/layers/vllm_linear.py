"""vLLM's `LinearMethodBase` run by our linear layers: the adapter between its calls and ours.

Our ColumnParallelLinear and RowParallelLinear call their method as `create_weights(layer, input_size,
output_size, params_dtype)`, `load_weight_rows(layer, row_offset, rows)` and `apply(layer, x, bias)`
(models/layers/quantization.py); vLLM's method is called as vLLM's parallel layers call it:

| our layer calls                          | the adapter calls vLLM's method                                   |
|------------------------------------------|-------------------------------------------------------------------|
| create_weights(layer, in, out, dtype)    | create_weights(layer, in, output_partition_sizes, input_size,     |
|                                          | output_size, dtype, weight_loader=layer.weight_loader) (sizes:    |
|                                          | this rank's shards, the whole layer's input and output)           |
| load_weight_rows(layer, offset, rows)    | (rows copied into `layer.weight`, which create_weights registered) |
| apply(layer, x, bias)                    | apply(layer, x, bias)                                             |
| process_weights_after_loading(layer)     | process_weights_after_loading(layer)                              |

What is accepted: `layer.weight` shaped (this rank's output rows, this rank's input columns), which the
checkpoint's float rows fill (a float checkpoint, quantized by the method in process_weights_after_loading:
vLLM's "online" form); other parameters the method registers are computed by it, never read from the
checkpoint. A pre-quantized checkpoint (int8 weights with their scales on disk) is not loaded through vLLM's
weight loaders here: docs/porting.md, quantization. Every call into the method is named when it raises.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.interfaces.plugin_code import describe_owner, plugin_hook
from asyncengine.interfaces.quantization import LinearMethod, LinearMethodBase

class VllmLinearMethod(LinearMethod):
    """Our LinearMethod over a vLLM-shaped `LinearMethodBase` (`plugin_method`)."""

    def __init__(self, plugin_method: LinearMethodBase) -> None:
        self.plugin_method = plugin_method
        self.computed_parameters: tuple[str, ...] = ()

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        # The layer's sizes as vLLM's layers hand them over (models/layers/linear.py sets them before this call).
        output_sizes = list(getattr(layer, "output_partition_sizes", [output_size]))
        whole_input = int(getattr(layer, "input_size", input_size))
        whole_output = int(getattr(layer, "output_size", output_size))
        before = {name for name, _ in layer.named_parameters(recurse=False)}
        with plugin_hook(self.plugin_method, "create_weights"):
            self.plugin_method.create_weights(layer, input_size, output_sizes, whole_input, whole_output,
                                              params_dtype, weight_loader=layer.weight_loader)
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, nn.Parameter) or tuple(weight.shape) != (output_size, input_size):
            shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
            raise ModelLoadError(
                f"quantization method {describe_owner(self.plugin_method)}: create_weights registered layer.weight "
                f"{'with shape ' + str(shape) if shape else 'not at all'}; this engine fills a weight shaped "
                f"{(output_size, input_size)} (this rank's output rows, input columns) from the checkpoint's float "
                "rows, and the method quantizes it in process_weights_after_loading (docs/porting.md, quantization)")
        added = {name for name, _ in layer.named_parameters(recurse=False)} - before - {"weight"}
        self.computed_parameters = tuple(sorted(added))

    def load_weight_rows(self, layer: nn.Module, row_offset: int, rows: torch.Tensor) -> None:
        weight: torch.Tensor = layer.weight  # type: ignore[assignment]
        weight.data.narrow(0, row_offset, rows.shape[0]).copy_(rows)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        with plugin_hook(self.plugin_method, "apply"):
            return self.plugin_method.apply(layer, x, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.plugin_method.process_weights_after_loading(layer)


def as_linear_method(method: Any) -> LinearMethod | None:
    """What a config's get_quant_method returned, as the method our layer runs: ours as it is, vLLM's through
    the adapter, None as None (unquantized)."""
    if method is None or isinstance(method, LinearMethod):
        return method
    if isinstance(method, LinearMethodBase):
        return VllmLinearMethod(method)
    raise ModelLoadError(f"get_quant_method returned {describe_owner(method)}, which is neither a LinearMethod nor "
                         "vLLM's LinearMethodBase (return None to leave the layer unquantized)")


__all__ = ["VllmLinearMethod", "as_linear_method"]
