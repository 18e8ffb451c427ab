"""Qwen2-VL: a vision transformer over 14x14 patches, whose 2x2 neighbours a merger folds into one embedding per
image token, and the Qwen2 language model with M-RoPE (asyncengine/models/layers/mrope.py).

The vision tower: a patch embedding (a Conv3d over (temporal, 14, 14) patches without bias, run here as the
matrix product it is: the processor already cut the patches), blocks of LayerNorm -> attention -> LayerNorm ->
MLP (quick GELU), each patch's query and key rotated by its row and column (2-D rotary: the first half of the
rotary frequencies by the row, the second by the column), attention within each image only (no mask: an
image's patches all see each other), then the merger: LayerNorm, the 2x2 neighbours' features side by side (the
processor orders patches so that neighbours are consecutive), an MLP to the language model's width.
Qwen2.5-VL changes the blocks (asyncengine/models/qwen2_5_vl.py).

The vision tower runs replicated on every tensor-parallel rank (small next to the language model); the
language model is Qwen2's, its rotary M-RoPE's. Checkpoint names: transformers 5's (`model.visual.`,
`model.language_model.`) and the older files' (`visual.`, `model.`) both load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.interfaces.multimodal_registry import MULTIMODAL_REGISTRY
from asyncengine.wire.multimodal import MultiModalFeature
from asyncengine.wire.tensors import tensor_from_wire
from asyncengine.models.layers.mrope import MRotaryEmbedding, mrope_positions
from asyncengine.models.layers.rotary import rotary_native
from asyncengine.models.qwen2 import Qwen2ForCausalLM, Qwen2Model
from asyncengine.models.qwen2_vl_processing import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)
from asyncengine.models.image_text import ImageTextModel, sub_config, text_config_of


def vision_activation(name: str) -> Any:
    """The vision MLP's activation by its transformers name."""
    table = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "silu": F.silu, "gelu": F.gelu,
             "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
    if name not in table:
        raise ValueError(f"vision hidden_act {name!r} is not supported (supported: {', '.join(table)})")
    return table[name]


def patch_positions(grid_thw: Sequence[Sequence[int]], merge: int) -> torch.Tensor:
    """`[patches, 2]` (row, column) of each patch, in the processor's order: merge x merge blocks row-major,
    and row-major inside each block; each frame alike."""
    rows: list[torch.Tensor] = []
    for t, h, w in grid_thw:
        row = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        col = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        pairs = torch.stack((row.transpose(1, 2).flatten(), col.transpose(1, 2).flatten()), dim=-1)
        rows.append(pairs.repeat(t, 1))
    return torch.cat(rows)


def image_segments(grid_thw: Sequence[Sequence[int]]) -> list[int]:
    """Patches per attention segment: each frame of each image attends within itself."""
    return [h * w for t, h, w in grid_thw for _ in range(t)]


class VisionRotary(nn.Module):
    """2-D rotary of the vision blocks: a patch's row turns the first half of the frequencies, its column the
    second (transformers' axial rope over head_dim / 2)."""

    inv_freq: torch.Tensor  # buffer: [head_dim / 4]

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        spatial = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)),
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[patches, 1, head_dim]` in float32 (the rotation runs in float32, as transformers')."""
        angles = (positions.unsqueeze(-1).float() * self.inv_freq).flatten(1)  # [patches, head_dim / 2]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True, dtype=dtype)
        self.proj = nn.Linear(dim, dim, bias=True, dtype=dtype)

    def forward(self, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                segments: list[int]) -> torch.Tensor:
        """Attention within each run of `segments` consecutive patches (an image, or a window of one)."""
        patches = hidden.shape[0]
        query, key, value = self.qkv(hidden).view(patches, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos_sin
        rotated_query, rotated_key = rotary_native(query.float(), key.float(), cos, sin)
        query, key = rotated_query.to(hidden.dtype), rotated_key.to(hidden.dtype)
        outputs = []
        for q, k, v in zip(*(t.transpose(0, 1).split(segments, dim=1) for t in (query, key, value))):
            outputs.append(F.scaled_dot_product_attention(q, k, v).transpose(0, 1))
        return self.proj(torch.cat(outputs).reshape(patches, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, dtype=dtype)
        self.fc2 = nn.Linear(hidden, dim, dtype=dtype)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: Any, *, dtype: torch.dtype) -> None:
        super().__init__()
        dim = self.width(config)
        self.norm1, self.norm2 = self.make_norm(dim, dtype), self.make_norm(dim, dtype)
        self.attn = VisionAttention(dim, config.num_heads, dtype=dtype)
        self.mlp = self.make_mlp(config, dtype)

    @staticmethod
    def width(config: Any) -> int:
        return int(config.embed_dim)

    @staticmethod
    def make_norm(dim: int, dtype: torch.dtype) -> nn.Module:
        return nn.LayerNorm(dim, eps=1e-6, dtype=dtype)

    def make_mlp(self, config: Any, dtype: torch.dtype) -> nn.Module:
        dim = self.width(config)
        return VisionMLP(dim, int(dim * config.mlp_ratio), config.hidden_act, dtype=dtype)

    def forward(self, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                segments: list[int]) -> torch.Tensor:
        hidden = hidden + self.attn(self.norm1(hidden), cos_sin, segments)
        return hidden + self.mlp(self.norm2(hidden))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int, norm: nn.Module, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.merged = dim * merge * merge
        self.ln_q = norm
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged, dtype=dtype), nn.GELU(),
                                 nn.Linear(self.merged, out_dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class PatchEmbed(nn.Module):
    """The Conv3d over (temporal, patch, patch) cubes without bias, as the matrix product it is on the
    processor's flattened patches `[patches, channels * temporal * patch * patch]`."""

    def __init__(self, config: Any, dim: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, dim, kernel, stride=kernel, bias=False, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return pixel_values.to(weight.dtype).reshape(-1, weight[0].numel()) @ weight.flatten(1).t()


class Qwen2VisionTransformer(nn.Module):
    block_cls: ClassVar[type[VisionBlock]] = VisionBlock

    def __init__(self, config: Any, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.merge = int(config.spatial_merge_size)
        dim = self.block_cls.width(config)
        self.patch_embed = PatchEmbed(config, dim, dtype=dtype)
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.rotary = VisionRotary(dim // config.num_heads, theta)
        self.blocks = nn.ModuleList([self.block_cls(config, dtype=dtype) for _ in range(config.depth)])
        self.merger = PatchMerger(self.output_width(config), dim, self.merge,
                                  self.block_cls.make_norm(dim, dtype), dtype=dtype)

    @staticmethod
    def output_width(config: Any) -> int:
        return int(config.hidden_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        """`[tokens, out_dim]`: one embedding per merged patch, images in order."""
        hidden = self.patch_embed(pixel_values)
        cos_sin = self.rotary(patch_positions(grid_thw, self.merge))
        segments = image_segments(grid_thw)
        for block in self.blocks:
            hidden = block(hidden, cos_sin, segments)
        return self.merger(hidden)


class Qwen2VLTextModel(Qwen2Model):
    rotary_cls = MRotaryEmbedding

    @staticmethod
    def rope_parameters(config: Any, key: str | None) -> dict[str, Any]:
        params = Qwen2Model.rope_parameters(config, key)
        if params["rope_type"] == "mrope":  # older configs: rope_scaling {"type": "mrope", "mrope_section": ...}
            params["rope_type"] = "default"
        return params


@MULTIMODAL_REGISTRY.register_processor(Qwen2VLMultiModalProcessor, info=Qwen2VLProcessingInfo,
                                        dummy_inputs=Qwen2VLDummyInputsBuilder)
class Qwen2VLForConditionalGeneration(ImageTextModel, Qwen2ForCausalLM):
    """SupportsMultiModal (asyncengine/interfaces/multimodal.py) and M-RoPE (`supports_mrope`: the model runner
    asks `get_mrope_input_positions` for each prompt's positions)."""

    supports_mrope: ClassVar[bool] = True
    supports_cuda_graphs: ClassVar[bool] = False  # the decode graphs' positions buffer is flat, M-RoPE's [3, tokens]
    tower_prefixes = ("model.visual.", "visual.")
    model_cls = Qwen2VLTextModel
    vision_cls: ClassVar[type[Qwen2VisionTransformer]] = Qwen2VisionTransformer

    def __init__(self, config: Any, *, dtype: torch.dtype, max_position: int) -> None:
        super().__init__(text_config_of(config), dtype=dtype, max_position=max_position)
        self.config = config
        self.visual = self.vision_cls(sub_config(config, "vision_config"), dtype=dtype)

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return "<|vision_start|><|image_pad|><|vision_end|>" if modality == "image" else None

    def embed_multimodal(self, **kwargs: Any) -> list[torch.Tensor]:
        """One `[tokens, hidden]` tensor per image from the items' `pixel_values` and `image_grid_thw`."""
        pixel_values, grids = kwargs.get("pixel_values"), kwargs.get("image_grid_thw")
        if pixel_values is None or len(pixel_values) == 0:
            return []
        if grids is None:
            raise ValueError("embed_multimodal: pixel_values without image_grid_thw (the processor gives both)")
        grid_rows = [[int(n) for n in torch.as_tensor(g).reshape(-1, 3)[row]] for g in grids
                     for row in range(torch.as_tensor(g).reshape(-1, 3).shape[0])]
        dtype = self.visual.patch_embed.proj.weight.dtype
        embeddings = self.visual(torch.cat([torch.as_tensor(p).to(dtype) for p in pixel_values]), grid_rows)
        merge = self.visual.merge
        return list(embeddings.split([t * h * w // (merge * merge) for t, h, w in grid_rows]))

    def get_mrope_input_positions(self, input_tokens: Sequence[int],
                                  mm_features: Sequence[MultiModalFeature] | None) -> tuple[torch.Tensor, int]:
        """vLLM's name: a prompt's `[3, tokens]` positions and its delta (layers/mrope.py), its images where
        their features say (`position.offset`, `image_grid_thw`)."""
        images = []
        for feature in mm_features or ():
            grid = feature.data.get("image_grid_thw")
            if grid is None:
                raise ValueError(f"image {feature.identifier} has no image_grid_thw among its processor outputs "
                                 f"({', '.join(feature.data)}): Qwen2-VL's positions need each image's grid")
            images.append((feature.position.offset, [int(n) for n in tensor_from_wire(grid).reshape(-1)[:3]]))
        return mrope_positions(len(input_tokens), images, spatial_merge_size=self.visual.merge)
