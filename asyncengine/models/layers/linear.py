"""Linear layers that split across tensor-parallel ranks, loading their part of each checkpoint tensor.

`ColumnParallelLinear` splits output features: rank r computes rows [start, end) of each of its shards
(q, k and v fused into one matrix, or gate and up), so no communication is needed. `RowParallelLinear`
splits input features: each rank multiplies its slice and the partial results are summed across ranks
(its bias added once, after the sum). With one rank both are plain linear layers.

Each layer's weight is created, loaded and applied by its `quant_method` (models/layers/quantization.py):
plain float unless the model is built with a quantization method (`quantization="int8"`, or a plugin's).
"""

from __future__ import annotations

import torch
from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.interfaces.quantization import LinearBase
from asyncengine.models.layers.quantization import linear_method_for
from asyncengine import parallel_state as parallel


class ColumnParallelLinear(nn.Module):
    """`y = x W^T (+ b)`; W stacks, per shard, the rows `shard_rows[i] = (start, end)` of checkpoint tensor i,
    which has `shard_sizes[i]` rows in all."""

    def __init__(
        self, in_features: int, shard_rows: list[tuple[int, int]], shard_sizes: list[int], *, bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.shard_rows = list(shard_rows)
        self.shard_sizes = list(shard_sizes)
        self.output_sizes = [end - start for start, end in shard_rows]
        out_features = sum(self.output_sizes)
        self.quant_method = linear_method_for(self)
        self.quant_method.create_weights(self, in_features, out_features, dtype)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    @property
    def num_shards(self) -> int:
        return len(self.shard_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None, name: str) -> None:
        shard = shard or 0
        start, end = self.shard_rows[shard]
        expected = (self.shard_sizes[shard],) + ((self.in_features,) if param is self.weight else ())
        check_shape(loaded, expected, name)
        offset = sum(self.output_sizes[:shard])
        if param is self.weight:
            self.quant_method.load_weight_rows(self, offset, loaded.narrow(0, start, end - start))
        else:
            copy_checked(param.data.narrow(0, offset, end - start), loaded.narrow(0, start, end - start), name)


class RowParallelLinear(nn.Module):
    """`y = sum over ranks of x_r W_r^T (+ b)`; this rank holds input columns `in_cols = (start, end)`."""

    def __init__(
        self, in_cols: tuple[int, int], in_total: int, out_features: int, *, bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.in_cols = in_cols
        self.in_total = in_total
        in_features = in_cols[1] - in_cols[0]
        self.quant_method = linear_method_for(self)
        self.quant_method.create_weights(self, in_features, out_features, dtype)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = parallel.all_reduce(self.quant_method.apply(self, x))
        return y if self.bias is None else y + self.bias

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None, name: str) -> None:
        if param is self.bias:
            copy_checked(param.data, loaded, name)
            return
        start, end = self.in_cols
        check_shape(loaded, (param.shape[0], self.in_total), name)
        self.quant_method.load_weight_rows(self, 0, loaded.narrow(1, start, end - start))


# vLLM's methods ask `isinstance(layer, LinearBase)` to choose which layers they quantize.
LinearBase.register(ColumnParallelLinear)
LinearBase.register(RowParallelLinear)


def check_shape(loaded: torch.Tensor, expected: tuple[int, ...], name: str) -> None:
    """The whole checkpoint tensor must have the shape config.json implies (before any rank takes its part)."""
    if tuple(loaded.shape) != tuple(expected):
        raise ModelLoadError(
            f"checkpoint tensor {name!r} has shape {tuple(loaded.shape)}, but the model built from "
            f"config.json expects {tuple(expected)}: the weights do not match the config"
        )


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy with a clear error when the checkpoint's tensor has the wrong shape."""
    check_shape(loaded, tuple(target.shape), name)
    target.copy_(loaded)
