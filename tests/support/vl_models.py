"""Tiny random vision-language models of the Qwen2-VL family and Gemma 3 (initializer_range 0.2), their real
image processors, and one prefill of our module on the paged attention path, for the model-level tests of
tests/models/test_qwen_vl_gemma3_mm.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

VOCAB = 320
IMAGE_TOKEN, VISION_START, VISION_END = 300, 301, 302
BOI, EOI = 303, 304  # Gemma 3's begin/end of image


def _text(extra: dict[str, Any]) -> dict[str, Any]:
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024, initializer_range=0.2,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)


def qwen2_vl_config() -> Any:
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=_text({"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                               "rope_theta": 10000.0}}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.2),
        image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        initializer_range=0.2)


def qwen2_5_vl_config() -> Any:
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=_text({"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                               "rope_theta": 10000.0}}),
        # Windows of 56 pixels (2x2 merged tokens): the 4x6-token image spans several, block 1 attends whole.
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1], hidden_act="silu", initializer_range=0.2),
        image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        initializer_range=0.2)


def gemma3_config() -> Any:
    from transformers import Gemma3Config

    # A sliding window of 8 on layer 0: the prompts reach past it, and an image's rows see later ones within it.
    return Gemma3Config(
        text_config=_text({"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                           "query_pre_attn_scalar": 16}),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=56, patch_size=14, vision_use_head=False, initializer_range=0.2),
        mm_tokens_per_image=4, image_token_id=IMAGE_TOKEN, boi_token_id=BOI, eoi_token_id=EOI,
        initializer_range=0.2)


def gemma3_image_processor() -> Any:
    from transformers import Gemma3ImageProcessor

    return Gemma3ImageProcessor(size={"height": 56, "width": 56})


def gemma3_prompt(num_images: int, text: list[list[int]]) -> list[int]:
    ids = list(text[0])
    for after in text[1:num_images + 1]:
        ids += [BOI] + [IMAGE_TOKEN] * 4 + [EOI] + list(after)
    return ids


def qwen_image_processor(kind: str) -> Any:
    from transformers import Qwen2VLImageProcessor

    # Small pixel bounds: the test images keep their sizes (multiples of 28) and stay a few dozen patches.
    return Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=200 * 28 * 28)


def two_images() -> list[Any]:
    """Two images of different sizes (and aspect ratios)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (112, 56, 3), dtype=np.uint8))]


def qwen_prompt(grids: list[list[int]], text: list[list[int]]) -> list[int]:
    """text[0], image 0's placeholders, text[1], ...: each image `vision_start, image_pad * n, vision_end`."""
    ids = list(text[0])
    for grid, after in zip(grids, text[1:]):
        ids += [VISION_START] + [IMAGE_TOKEN] * (grid[0] * grid[1] * grid[2] // 4) + [VISION_END] + list(after)
    return ids


@dataclass
class Bound:
    """Our model with a KV cache and the torch backend bound, for direct prefills."""

    model: Any
    block_size: int = 16

    def prefill(self, token_ids: list[int], positions: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        from asyncengine.models.layers.attention import AttentionMetadata

        n = len(token_ids)
        blocks = -(-n // self.block_size)
        metadata = AttentionMetadata(torch.arange(n), None, [n], [n], torch.arange(blocks).unsqueeze(0),
                                     block_size=self.block_size)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(token_ids), positions, metadata, inputs_embeds=inputs_embeds)
            return self.model.compute_logits(hidden).float()


def bind(model: Any, num_blocks: int = 32, block_size: int = 16) -> Bound:
    from asyncengine.attention.torch_paged import TorchPagedBackend
    from asyncengine.interfaces.attention import build_backend
    from asyncengine.models.layers.attention import PagedAttention

    for layer in model.modules():
        if isinstance(layer, PagedAttention):
            shape = (layer.num_kv_heads, num_blocks, block_size, layer.head_dim)
            layer.kv_cache = (torch.zeros(shape), torch.zeros(shape))
            layer.backend = build_backend(TorchPagedBackend, layer.num_heads, layer.num_kv_heads, layer.head_dim,
                                          layer.scale, sliding_window=layer.sliding_window,
                                          logits_soft_cap=layer.logits_soft_cap)
    return Bound(model, block_size)


def ours_from(hf_model: Any, cls: type, max_position: int = 1024) -> Bound:
    """Our `cls` built from `hf_model`'s config with its weights (float32)."""
    model = cls(hf_model.config, dtype=torch.float32, max_position=max_position)
    model.load_weights((name, tensor.detach().clone()) for name, tensor in hf_model.state_dict().items())
    return bind(model.eval())
