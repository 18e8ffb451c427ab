"""LLaVA (LlavaForConditionalGeneration): a CLIP vision tower, a two-layer projector, a Llama language model.

The image's patch features are taken from the tower's hidden states at `vision_feature_layer` (several layers'
concatenated when it is a list), without the CLS token under the "default" select strategy, then projected:
one embedding per patch, every position of the item's placeholder span. One item's processor outputs:
`pixel_values` (1, 3, H, W).

Its input processing is the registry's default (transformers' LlavaProcessor expands each `<image>` into one token
per patch), registered under vLLM's three names, which plugins import to register a LLaVA subclass as vLLM's own
multimodal test plugin does (`@MULTIMODAL_REGISTRY.register_processor(LlavaMultiModalProcessor,
info=LlavaProcessingInfo, dummy_inputs=LlavaDummyInputsBuilder)`; docs/porting.md, multimodal models).
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


class LlavaProcessingInfo(BaseProcessingInfo):
    """LLaVA's processing info: the HF processor from the model's folder; no per-prompt image limit of its own."""


class LlavaDummyInputsBuilder(BaseDummyInputsBuilder):
    """LLaVA's profiling inputs: one `<image>` per image, blank images of the processor's resize size."""


class LlavaMultiModalProcessor(BaseMultiModalProcessor):
    """LLaVA's processor: each image through the HF image processor, its `<image>` repeated once per patch."""


@MULTIMODAL_REGISTRY.register_processor(LlavaMultiModalProcessor, info=LlavaProcessingInfo,
                                        dummy_inputs=LlavaDummyInputsBuilder)
class LlavaForConditionalGeneration(LlamaBackedVisionLanguageModel):
    config_class = "LlavaConfig"
    checkpoint_prefixes = (
        # transformers 5's names
        ("model.language_model.", "language:model."),
        ("lm_head.", "language:lm_head."),
        ("model.vision_tower.", "vision:vision_tower."),
        ("model.multi_modal_projector.", "vision:multi_modal_projector."),
        # the older ones (llava-hf checkpoints, vLLM's test models)
        ("language_model.model.", "language:model."),
        ("language_model.lm_head.", "language:lm_head."),
        ("vision_tower.", "vision:vision_tower."),
        ("multi_modal_projector.", "vision:multi_modal_projector."),
    )

    def build_vision(self, hf_config: Any) -> dict[str, nn.Module]:
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.feature_layer = hf_config.vision_feature_layer
        self.select_strategy = hf_config.vision_feature_select_strategy
        return {"vision_tower": AutoModel.from_config(hf_config.vision_config),
                "multi_modal_projector": LlavaMultiModalProjector(hf_config)}

    def embed_multimodal(self, **kwargs: Any) -> list[torch.Tensor]:
        pixel_values = kwargs.get("pixel_values") or []
        if not pixel_values:
            return []
        images = [values.reshape(-1, *values.shape[-3:]).to(self.vision_dtype) for values in pixel_values]
        counts = [image.shape[0] for image in images]
        if len({tuple(image.shape[1:]) for image in images}) == 1:  # one tower call for the step's images
            features = self._embed(torch.cat(images))
            return [rows.reshape(-1, rows.shape[-1]) for rows in features.split(counts)]
        return [self._embed(image).reshape(-1, self.config.hidden_size) for image in images]

    def _embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden_states = self.vision["vision_tower"](pixel_values, output_hidden_states=True).hidden_states
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        selected = [hidden_states[layer] for layer in layers]
        if self.select_strategy == "default":
            selected = [state[:, 1:] for state in selected]
        return self.vision["multi_modal_projector"](torch.cat(selected, dim=-1))
