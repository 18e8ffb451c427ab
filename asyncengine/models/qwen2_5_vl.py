"""Qwen2.5-VL: Qwen2-VL (asyncengine/models/qwen2_vl.py) with other vision blocks: RMSNorm in place of LayerNorm
(the merger's too), a gated SiLU MLP with biases (SwiGLU), and window attention: the patches are reordered
so that each window of `window_size` pixels (in merged units) is consecutive, most blocks attend within a
window, the blocks of `fullatt_block_indexes` within the whole image; the merger's output is put back in
the processor's order. The language model is the same (Qwen2 with M-RoPE)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.models.layers.norm import RMSNorm
from asyncengine.models.qwen2_vl import (
    Qwen2VisionTransformer,
    Qwen2VLForConditionalGeneration,
    VisionBlock,
    image_segments,
    patch_positions,
    vision_activation,
)


class GatedVisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, dtype=dtype)
        self.up_proj = nn.Linear(dim, hidden, dtype=dtype)
        self.down_proj = nn.Linear(hidden, dim, dtype=dtype)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen2_5VisionBlock(VisionBlock):
    @staticmethod
    def width(config: Any) -> int:
        return int(config.hidden_size)

    @staticmethod
    def make_norm(dim: int, dtype: torch.dtype) -> nn.Module:
        return RMSNorm(dim, eps=1e-6, dtype=dtype)

    def make_mlp(self, config: Any, dtype: torch.dtype) -> nn.Module:
        return GatedVisionMLP(self.width(config), int(config.intermediate_size), config.hidden_act, dtype=dtype)


def window_order(grid_thw: list[list[int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """(the merged units in window order, as indices into the processor's order; merged units per window).

    Each frame's grid of merged units is cut into `window` x `window` squares (the last row and column of
    squares cut short), read square by square, row-major inside each."""
    order: list[torch.Tensor] = []
    sizes: list[int] = []
    offset = 0
    for t, h, w in grid_thw:
        rows, cols = h // merge, w // merge
        units = torch.arange(t * rows * cols).view(t, rows, cols)
        for frame in range(t):
            for top in range(0, rows, window):
                for left in range(0, cols, window):
                    square = units[frame, top:top + window, left:left + window].flatten()
                    order.append(square + offset)
                    sizes.append(square.numel())
        offset += t * rows * cols
    return torch.cat(order), sizes


class Qwen2_5VisionTransformer(Qwen2VisionTransformer):
    block_cls = Qwen2_5VisionBlock

    def __init__(self, config: Any, *, dtype: torch.dtype) -> None:
        super().__init__(config, dtype=dtype)
        self.full_attention_blocks = frozenset(int(i) for i in config.fullatt_block_indexes)
        self.window = int(config.window_size) // self.merge // int(config.patch_size)

    @staticmethod
    def output_width(config: Any) -> int:
        return int(config.out_hidden_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        unit = self.merge * self.merge
        order, window_units = window_order(grid_thw, self.merge, self.window)

        def windowed(x: torch.Tensor) -> torch.Tensor:  # whole merged units moved, their patches kept together
            return x.view(-1, unit, *x.shape[1:])[order].flatten(0, 1)

        hidden = windowed(self.patch_embed(pixel_values))
        cos, sin = self.rotary(patch_positions(grid_thw, self.merge))
        cos_sin = (windowed(cos), windowed(sin))
        images, windows = image_segments(grid_thw), [n * unit for n in window_units]
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, cos_sin, images if index in self.full_attention_blocks else windows)
        return self.merger(hidden)[torch.argsort(order)]


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_cls: ClassVar[type[Qwen2VisionTransformer]] = Qwen2_5VisionTransformer
