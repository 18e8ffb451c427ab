"""Linear layers whose weights may be stored as several checkpoint tensors (shards).

Fusing q/k/v (and gate/up) into one matrix makes one matmul instead of three; the checkpoint still
names them separately, so each shard is copied into its rows when weights load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.errors import ModelLoadError


class MergedLinear(nn.Module):
    """`y = x W^T (+ b)` where W stacks `len(output_sizes)` shards along the output dimension."""

    def __init__(self, in_features: int, output_sizes: list[int], *, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        out_features = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int, name: str) -> None:
        """Copy checkpoint tensor `loaded` (named `name`) into shard `shard` of `param`."""
        start = sum(self.output_sizes[:shard])
        target = param.data.narrow(0, start, self.output_sizes[shard])
        copy_checked(target, loaded, name)


class Linear(MergedLinear):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, [out_features], bias=bias, dtype=dtype)


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy with a clear error when the checkpoint's tensor has the wrong shape."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise ModelLoadError(
            f"checkpoint tensor {name!r} has shape {tuple(loaded.shape)}, but the model built from "
            f"config.json expects {tuple(target.shape)}: the weights do not match the config"
        )
    target.copy_(loaded)
