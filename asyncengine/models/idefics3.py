"""Idefics3 and SmolVLM (Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration): a SigLIP-like vision
transformer, a pixel-shuffle connector, a Llama language model (SmolLM2 in SmolVLM: our Llama path).

The processor splits an image into tiles (plus a downscaled global view), each `image_size` square; every tile
becomes `(image_size / patch_size)^2 / scale_factor^2` embeddings, its placeholder tokens in the prompt framed by
text tokens (`<fake_token_around_image>`, `<row_1_col_1>`, `<global-img>`), which the item's `is_embed` leaves out.
One item's processor outputs: `pixel_values` (1, tiles, 3, H, W), `pixel_attention_mask` (1, tiles, H, W).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncengine.interfaces.multimodal_registry import (
    MULTIMODAL_REGISTRY,
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
)
from asyncengine.models.vision_language import LlamaBackedVisionLanguageModel


# Its processing is the registry's default (transformers' Idefics3Processor), registered as every multimodal
# class's is: a worker reads the registration to profile with its dummy inputs (SmolVLM inherits it).
@MULTIMODAL_REGISTRY.register_processor(BaseMultiModalProcessor, info=BaseProcessingInfo,
                                        dummy_inputs=BaseDummyInputsBuilder)
class Idefics3ForConditionalGeneration(LlamaBackedVisionLanguageModel):
    config_class = "Idefics3Config"
    modeling_module = "transformers.models.idefics3.modeling_idefics3"
    class_prefix = "Idefics3"
    checkpoint_prefixes = (
        ("model.text_model.", "language:model."),
        ("lm_head.", "language:lm_head."),
        ("model.vision_model.", "vision:vision_model."),
        ("model.connector.", "vision:connector."),
    )

    def build_vision(self, hf_config: Any) -> dict[str, nn.Module]:
        import importlib

        module = importlib.import_module(self.modeling_module)
        self.patch_size = hf_config.vision_config.patch_size
        return {"vision_model": getattr(module, f"{self.class_prefix}VisionTransformer")(hf_config.vision_config),
                "connector": getattr(module, f"{self.class_prefix}Connector")(hf_config)}

    def embed_multimodal(self, **kwargs: Any) -> list[torch.Tensor]:
        pixel_values = kwargs.get("pixel_values") or []
        masks = kwargs.get("pixel_attention_mask") or [None] * len(pixel_values)
        return [self._embed_image(values, mask) for values, mask in zip(pixel_values, masks)]

    def _embed_image(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None) -> torch.Tensor:
        """One image's tiles -> its embedding rows, tile after tile (as transformers' get_image_features)."""
        tiles = pixel_values.reshape(-1, *pixel_values.shape[-3:]).to(self.vision_dtype)
        real = (tiles == 0.0).sum(dim=(-1, -2, -3)) != tiles[0].numel()  # padding tiles are all zeros
        tiles = tiles[real]
        if pixel_attention_mask is None:
            mask = torch.ones((tiles.shape[0], *tiles.shape[-2:]), dtype=torch.bool, device=tiles.device)
        else:
            mask = pixel_attention_mask.reshape(-1, *pixel_attention_mask.shape[-2:])[real].bool()
        size = self.patch_size
        patches = mask.unfold(1, size, size).unfold(2, size, size)
        patch_mask = patches.sum(dim=(-1, -2)) > 0
        hidden = self.vision["vision_model"](pixel_values=tiles, patch_attention_mask=patch_mask).last_hidden_state
        features = self.vision["connector"](hidden)
        return features.reshape(-1, features.shape[-1])


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """transformers' SmolVLM classes (the same layout and checkpoint names as Idefics3's)."""

    config_class = "SmolVLMConfig"
    modeling_module = "transformers.models.smolvlm.modeling_smolvlm"
    class_prefix = "SmolVLM"
