"""M-RoPE (multimodal rotary position embedding) of the Qwen2-VL family: three positions per token.

Each token has a temporal, a height and a width position. A text token's three are equal and count up by one
as in plain RoPE; an image's placeholder tokens (one per merged patch, row-major over the merged grid) all
share the temporal position where the image starts, and their height and width positions are that start plus
their row and column. The text after an image resumes at the start plus the larger side of the merged grid,
so the prompt's positions end below its length: `delta` (last position + 1 - prompt length, <= 0) is what a
generated token adds to its index to continue them (every token after the prompt is text).

The rotary dimensions are split by the config's `mrope_section` (three counts summing to half the rotary
dimension, repeated for the other half): the first section rotates by the temporal position, the second by
the height, the third by the width. `MRotaryEmbedding.lookup` takes `[3, tokens]` positions (or `[tokens]`,
all three equal) and returns cos/sin of the plain layout, so the attention layers rotate as for any model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from asyncengine.errors import ModelLoadError
from asyncengine.models.layers.rotary import RotaryEmbedding


def mrope_positions(num_tokens: int, images: Sequence[tuple[int, Sequence[int]]], *,
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """The `[3, num_tokens]` int64 positions of a prompt and its delta (the module's docstring).

    `images`: (offset of its first placeholder token, its (temporal, height, width) grid of patches before
    merging: the processor's `image_grid_thw` row) of each image, in prompt order; it takes the
    `t * h * w / spatial_merge_size**2` tokens from its offset. Every other token is text (an image token id
    typed into a prompt without its image too, as transformers' `mm_token_type_ids` has it). Images that
    overlap, run past the prompt or come out of order are a ValueError."""
    positions = torch.empty((3, num_tokens), dtype=torch.int64)
    start = index = 0  # the next text position, the next token
    for offset, grid in images:
        frames, rows, cols = (int(grid[0]), int(grid[1]) // spatial_merge_size, int(grid[2]) // spatial_merge_size)
        length = frames * rows * cols
        if offset < index or offset + length > num_tokens:
            raise ValueError(f"an image of grid {list(grid)} needs placeholder tokens {offset}..{offset + length - 1}: "
                             f"they overlap the previous image or run past the prompt's {num_tokens} tokens")
        positions[:, index:offset] = torch.arange(start, start + offset - index)
        start += offset - index
        block = positions[:, offset:offset + length]
        block[0] = start + torch.arange(frames).repeat_interleave(rows * cols)
        block[1] = start + torch.arange(rows).repeat_interleave(cols).repeat(frames)
        block[2] = start + torch.arange(cols).repeat(frames * rows)
        start += max(frames, rows, cols)
        index = offset + length
    positions[:, index:] = torch.arange(start, start + num_tokens - index)
    start += num_tokens - index
    return positions, start - num_tokens


class MRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose `lookup` takes `[3, tokens]` positions, each rotary section turned by its axis.

    Built as RotaryEmbedding, with `params["mrope_section"]` (the config's `rope_parameters`, or its older
    `rope_scaling`, carry it)."""

    axis_of_dim: torch.Tensor  # buffer: [rotary_dim]

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__(head_dim, max_position, params)
        section = [int(n) for n in params.get("mrope_section") or ()]
        half = self.rotary_dim // 2
        if len(section) != 3 or sum(section) != half or not self.is_neox_style:
            raise ModelLoadError(f"mrope_section {section} must be three counts summing to half the rotary "
                                 f"dimension ({half}), with the NeoX rotation")
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
        # Which of the three positions turns each rotary dimension (the two halves alike).
        self.register_buffer("axis_of_dim", torch.cat((axis, axis)), persistent=False)
        self.mrope_section = section

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().lookup(positions, dtype)
        tokens = positions.shape[1]
        index = self.axis_of_dim.view(1, 1, -1).expand(1, tokens, -1)
        cos = self.cos_table[positions].gather(0, index).squeeze(0)  # [tokens, rotary_dim]
        sin = self.sin_table[positions].gather(0, index).squeeze(0)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)
