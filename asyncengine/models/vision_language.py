"""What the vision-language models on the Llama path share: a vision part (the vision tower and its connector or
projector, from transformers' modelling code: it runs once per image, off the decode path) in front of our Llama
language model (paged attention, tensor parallel layers), with vLLM's SupportsMultiModal interface
(asyncengine/interfaces/multimodal.py).

A subclass builds its vision modules (`build_vision`), says which checkpoint prefixes are the language model's
and which the vision part's (`checkpoint_prefixes`, transformers 5's names and the older ones), and turns one
item's processor outputs into its embedding rows (`embed_multimodal`).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.interfaces.multimodal import MultiModalEmbeddings, merge_multimodal_embeddings
from asyncengine.models.layers.attention import AttentionMetadata
from asyncengine.models.llama import LlamaForCausalLM


def transformers_config(config: Any, class_name: str) -> Any:
    """The model's config as transformers' `class_name` (the engine hands models a namespace of config.json's
    completed values; the vision modules are transformers' and read its config objects)."""
    import transformers

    values = dict(vars(config)) if not isinstance(config, dict) else dict(config)
    config_cls = getattr(transformers, class_name)
    hf_config = config_cls(**values)
    hf_config.vision_config._attn_implementation = "sdpa"
    return hf_config


class LlamaBackedVisionLanguageModel(nn.Module):
    supports_multimodal: ClassVar[Literal[True]] = True
    config_class: ClassVar[str]
    # (checkpoint prefix, where it goes): "language:" + our Llama's prefix, or "vision:" + a vision module's.
    checkpoint_prefixes: ClassVar[tuple[tuple[str, str], ...]]

    def __init__(self, config: Any, *, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.hf_config = transformers_config(config, self.config_class)
        text = self.hf_config.text_config.to_dict()
        text["tie_word_embeddings"] = bool(getattr(self.hf_config, "tie_word_embeddings", False)
                                           or text.get("tie_word_embeddings", False))
        self.config = SimpleNamespace(**text)
        self.language_model = LlamaForCausalLM(self.config, dtype=dtype, max_position=max_position)
        self.vision = nn.ModuleDict(self.build_vision(self.hf_config)).to(dtype)
        self.vision_dtype = dtype

    # -- what a subclass gives -----------------------------------------------------------------------------------

    def build_vision(self, hf_config: Any) -> dict[str, nn.Module]:
        raise NotImplementedError(f"{type(self).__name__} must build its vision modules")

    def embed_multimodal(self, **kwargs: Any) -> MultiModalEmbeddings:
        raise NotImplementedError(f"{type(self).__name__} must implement embed_multimodal")

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return "<image>" if modality.startswith("image") else None

    # -- the language model --------------------------------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings: MultiModalEmbeddings | None = None,
                        *, is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.language_model.model.embed_input_ids(input_ids)
        return merge_multimodal_embeddings(embeds, multimodal_embeddings, is_multimodal)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    # -- weights -------------------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        language: list[tuple[str, torch.Tensor]] = []
        vision: dict[str, torch.Tensor] = {}
        unexpected: list[str] = []
        for name, tensor in weights:
            for prefix, target in self.checkpoint_prefixes:
                if name.startswith(prefix):
                    part, _, where = target.partition(":")
                    renamed = where + name[len(prefix):]
                    if part == "language":
                        language.append((renamed, tensor))
                    else:
                        vision[renamed] = tensor
                    break
            else:
                unexpected.append(name)
        if unexpected:
            raise ModelLoadError(f"the checkpoint has tensors this {type(self).__name__} does not place: "
                                 f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
        loaded = {f"language_model.{name}" for name in self.language_model.load_weights(language)}
        missing, extra = self.vision.load_state_dict(vision, strict=False)
        if missing or extra:
            raise ModelLoadError(f"{type(self).__name__}'s vision weights do not match the checkpoint: missing "
                                 f"{missing[:5]}, unexpected {extra[:5]}")
        return loaded | {f"vision.{name}" for name in vision}
