"""Gemma 3 with images (Gemma3ForConditionalGeneration): a SigLIP vision tower, a projector, and the Gemma 3 text
model (asyncengine/models/gemma3.py).

Each image, resized by the processor to the tower's square `image_size`, is cut into patches (a strided
convolution), given learned position embeddings, run through pre-norm transformer layers (full attention
among its patches, GELU-tanh MLP) and a final LayerNorm. The projector averages the patch grid down to
`mm_tokens_per_image` (a square: `avg_pool` over kernel x kernel patches), normalizes each with Gemma's
`(1 + w)` RMSNorm and maps it to the text width: one embedding per image token. The tower runs replicated on
every tensor-parallel rank.

The image tokens attend to each other both ways: transformers' Gemma 3, given the processor's
`token_type_ids` (as its generate is), lets every token of an image see the whole image, later tokens
included (within the sliding window on the sliding layers), and every other token causally. Here each
attention layer does the same (`ImageBidirectionalAttention`): the backend computes the causal result, then
the rows of each image are recomputed over their sequence's keys up to the image's end. An image whose
tokens a chunked prefill splits across two steps is seen both ways only within each step (an earlier chunk
cannot see tokens not computed yet): keep `max_num_batched_tokens` above an image's tokens (256 for Gemma 3)
for transformers' result (docs/multimodal.md).
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.interfaces.multimodal_registry import (
    MULTIMODAL_REGISTRY,
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
)
from asyncengine.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3Model
from asyncengine.models.layers.attention import AttentionMetadata, PagedAttention
from asyncengine.models.layers.norm import GemmaRMSNorm
from asyncengine.models.qwen2_vl import vision_activation
from asyncengine.models.image_text import ImageTextModel, sub_config, text_config_of

logger = logging.getLogger(__name__)


class SiglipAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim, dtype=dtype)
        self.k_proj = nn.Linear(dim, dim, dtype=dtype)
        self.v_proj = nn.Linear(dim, dim, dtype=dtype)
        self.out_proj = nn.Linear(dim, dim, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        images, patches, _ = hidden.shape
        q, k, v = (proj(hidden).view(images, patches, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class SiglipMLP(nn.Module):
    def __init__(self, config: Any, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, dtype=dtype)
        self.act = vision_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipLayer(nn.Module):
    def __init__(self, config: Any, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.self_attn = SiglipAttention(config.hidden_size, config.num_attention_heads, dtype=dtype)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.mlp = SiglipMLP(config, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: Any, *, dtype: torch.dtype) -> None:
        super().__init__()
        patch = int(config.patch_size)
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, patch, stride=patch, dtype=dtype)
        self.position_embedding = nn.Embedding((config.image_size // patch) ** 2, config.hidden_size, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipEncoder(nn.Module):
    def __init__(self, config: Any, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList([SiglipLayer(config, dtype=dtype) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer without its pooling head: `[images, patches, hidden]`."""

    def __init__(self, config: Any, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config, dtype=dtype)
        self.encoder = SiglipEncoder(config, dtype=dtype)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, config: Any, *, dtype: torch.dtype) -> None:
        super().__init__()
        vision = sub_config(config, "vision_config")
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vision.hidden_size, sub_config(config, "text_config").hidden_size, dtype=dtype),
            requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps, dtype=dtype)
        self.patches_per_side = int(vision.image_size // vision.patch_size)
        self.kernel = self.patches_per_side // math.isqrt(int(config.mm_tokens_per_image))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        images, _, width = patches.shape
        grid = patches.transpose(1, 2).reshape(images, width, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class ImageRows:
    """This step's image tokens, set by the model before each forward, read by every attention layer: per
    image run, (first row in the step's batch, rows, the sequence's index in the batch)."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, int]] = []


class ImageBidirectionalAttention(PagedAttention):
    """PagedAttention whose image rows see their whole image (the module's docstring)."""

    image_rows: ImageRows

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        output = super().forward(query, key, value, metadata)
        if not self.image_rows.runs:
            return output
        output = output.clone()
        group = metadata.for_group(self.kv_cache_group)
        if self.kv_cache is None:  # (super().forward refused already)
            raise RuntimeError("attention layer has no KV cache bound")
        key_cache, value_cache = self.kv_cache  # [kv_heads, blocks, block_size, head_dim]
        block_size = key_cache.shape[2]
        for first_row, rows, seq in self.image_rows.runs:
            context = group.seq_lens[seq] - group.query_lens[seq]  # positions before this step's rows
            start_row = int(group.query_start_loc[seq])
            first_pos = context + first_row - start_row
            last_pos = first_pos + rows  # exclusive: the image's end in this step
            low = 0 if self.sliding_window is None else max(0, first_pos - self.sliding_window + 1)
            positions = torch.arange(low, last_pos, device=key_cache.device)
            slots_block = group.block_tables[seq, positions // block_size]
            keys = key_cache[:, slots_block, positions % block_size].float()  # [kv_heads, keys, head_dim]
            values = value_cache[:, slots_block, positions % block_size].float()
            queries = query[first_row:first_row + rows].float().transpose(0, 1)  # [heads, rows, head_dim]
            repeat = self.num_heads // self.num_kv_heads
            scores = queries @ keys.repeat_interleave(repeat, 0).transpose(1, 2) * self.scale
            if self.logits_soft_cap is not None:
                scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
            query_pos = torch.arange(first_pos, last_pos, device=key_cache.device).unsqueeze(1)
            allowed = (positions.unsqueeze(0) <= query_pos) | (positions.unsqueeze(0) >= first_pos)
            if self.sliding_window is not None:
                allowed &= query_pos - positions.unsqueeze(0) < self.sliding_window
            weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            rows_out = (weights @ values.repeat_interleave(repeat, 0)).transpose(0, 1)
            output[first_row:first_row + rows] = rows_out.flatten(1).to(output.dtype)
        return output


class Gemma3ImageTextAttention(Gemma3Attention):
    def __init__(self, config: Any, *, dtype: torch.dtype, layer_index: int = 0) -> None:
        super().__init__(config, dtype=dtype, layer_index=layer_index)
        plain = self.attn
        self.attn = ImageBidirectionalAttention(plain.num_heads, plain.num_kv_heads, plain.head_dim, plain.scale,
                                                sliding_window=plain.sliding_window,
                                                logits_soft_cap=plain.logits_soft_cap, layer_index=layer_index)


class Gemma3ImageTextDecoderLayer(Gemma3DecoderLayer):
    attention_cls = Gemma3ImageTextAttention


class Gemma3ImageTextModel(Gemma3Model):
    layer_cls = Gemma3ImageTextDecoderLayer


# Its processing is the registry's default (transformers' Gemma3Processor), registered as every multimodal class's
# is: a worker reads the registration to profile with its dummy inputs.
@MULTIMODAL_REGISTRY.register_processor(BaseMultiModalProcessor, info=BaseProcessingInfo,
                                        dummy_inputs=BaseDummyInputsBuilder)
class Gemma3ForConditionalGeneration(ImageTextModel, Gemma3ForCausalLM):
    model_cls = Gemma3ImageTextModel
    tower_name = "vision_tower"
    tower_prefixes = ("model.vision_tower.vision_model.", "model.vision_tower.", "vision_tower.vision_model.",
                      "vision_tower.")
    other_modules = ("multi_modal_projector",)
    unused_prefixes = ("model.vision_tower.head.", "vision_tower.vision_model.head.",
                       "model.vision_tower.vision_model.head.")

    def __init__(self, config: Any, *, dtype: torch.dtype, max_position: int) -> None:
        super().__init__(text_config_of(config), dtype=dtype, max_position=max_position)
        self.config = config
        # transformers' Gemma3Config stores it as image_token_index (image_token_id is its alias)
        self.image_token_id = int(getattr(config, "image_token_id", None) or config.image_token_index)
        self.vision_tower = SiglipVisionTower(sub_config(config, "vision_config"), dtype=dtype)
        self.multi_modal_projector = Gemma3MultiModalProjector(config, dtype=dtype)
        self.image_rows = ImageRows()
        self._warned_split = False
        for module in self.model.modules():
            if isinstance(module, ImageBidirectionalAttention):
                module.image_rows = self.image_rows

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return "<start_of_image>" if modality == "image" else None

    def embed_multimodal(self, **kwargs: Any) -> list[torch.Tensor]:
        """One `[mm_tokens_per_image, hidden]` tensor per image (each item's `pixel_values`: `[crops, 3, s, s]`,
        each crop one image's tokens)."""
        pixel_values = kwargs.get("pixel_values")
        if pixel_values is None or len(pixel_values) == 0:
            return []
        stacked = torch.cat([torch.as_tensor(p).reshape(-1, *torch.as_tensor(p).shape[-3:]) for p in pixel_values])
        per_image = self.multi_modal_projector(self.vision_tower(stacked))
        counts = [torch.as_tensor(p).reshape(-1, *torch.as_tensor(p).shape[-3:]).shape[0] for p in pixel_values]
        return [embeddings.flatten(0, 1) for embeddings in per_image.split(counts)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        self.image_rows.runs = self._image_runs(input_ids, metadata) if inputs_embeds is not None else []
        try:
            return super().forward(input_ids, positions, metadata, inputs_embeds)
        finally:
            self.image_rows.runs = []

    def _image_runs(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> list[tuple[int, int, int]]:
        """(first row, rows, sequence) of each run of image tokens in this step, a run never crossing sequences."""
        is_image = (input_ids == self.image_token_id).tolist()
        if not any(is_image):
            return []
        runs: list[tuple[int, int, int]] = []
        start = 0
        for seq, length in enumerate(metadata.query_lens):
            row = start
            while row < start + length:
                if not is_image[row]:
                    row += 1
                    continue
                end = row
                while end < start + length and is_image[end]:
                    end += 1
                if end - row > 1:  # one token alone sees itself either way
                    runs.append((row, end - row, seq))
                if end == start + length and length > 1 and not self._warned_split:  # a prefill chunk ends in it
                    self._warned_split = True  # (an image always ends with <end_of_image>: it continues next step)
                    logger.warning("a prompt's image is split across two steps: its tokens in the first cannot see "
                                   "the later ones, which transformers' Gemma 3 lets them; raise "
                                   "max_num_batched_tokens above an image's tokens for identical outputs")
                row = end
            start += length
        return runs
