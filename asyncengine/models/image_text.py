"""What the image-and-text models with native image towers share (Qwen2-VL, Qwen2.5-VL, Gemma 3): a language
model class of this package, subclassed (its checkpoint names and hooks kept) and given an image tower,
built from the composite config's `text_config`, and the two steps
of vLLM's SupportsMultiModal that do not depend on the tower (asyncengine/interfaces/multimodal.py):
the token embeddings with the images' rows replaced (`embed_input_ids`), and transformers 5's checkpoint
names (`model.language_model.`, `model.<tower>.`) read as this package's (`model.`, `<tower>.`)."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from asyncengine.interfaces.multimodal import MultiModalEmbeddings, merge_multimodal_embeddings


def sub_config(config: Any, name: str) -> Any:
    """The composite config's `name` (`text_config`, `vision_config`) with attribute access: the worker builds
    models from config.json's dict as a namespace, whose nested configs stay dicts."""
    sub = getattr(config, name)
    return SimpleNamespace(**sub) if isinstance(sub, dict) else sub


def text_config_of(config: Any) -> Any:
    """The composite config's `text_config`, carrying the composite's `tie_word_embeddings` (transformers 5
    keeps it on the outer config only)."""
    text = copy.copy(sub_config(config, "text_config"))
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    return text


class ImageTextModel:
    """Mixin before a LlamaForCausalLM subclass (`model` its language model, `embed_tokens`, `embed_scale`)."""

    supports_multimodal: ClassVar[bool] = True
    # The tower's attribute name here, and the prefixes its tensors have in checkpoints (transformers 5's first).
    tower_name: ClassVar[str] = "visual"
    tower_prefixes: ClassVar[tuple[str, ...]] = ("model.visual.",)
    # Other modules beside the language model, under `model.` in transformers 5's checkpoints (Gemma 3's projector).
    other_modules: ClassVar[tuple[str, ...]] = ()
    # Checkpoint tensors no forward reads (SigLIP's pooling head, which Gemma 3 does not use).
    unused_prefixes: ClassVar[tuple[str, ...]] = ()
    model: Any

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings: MultiModalEmbeddings | None = None,
                        *, is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens' embeddings (scaled as the language model scales its own: Gemma's sqrt(hidden_size)), the
        rows where `is_multimodal` is True replaced in order by the items' embeddings."""
        return merge_multimodal_embeddings(self.model.embed_input_ids(input_ids), multimodal_embeddings,
                                           is_multimodal)

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.startswith(self.unused_prefixes):
                continue
            if name.startswith("model.language_model."):
                name = "model." + name.removeprefix("model.language_model.")
            elif name.startswith("language_model.model."):  # transformers 4's LLaVA-style layout
                name = "model." + name.removeprefix("language_model.model.")
            elif name.startswith("language_model.lm_head."):
                name = name.removeprefix("language_model.")
            elif name.split(".")[1:2] and name.split(".")[1] in self.other_modules and name.startswith("model."):
                name = name.removeprefix("model.")
            else:
                for prefix in self.tower_prefixes:
                    if name.startswith(prefix):
                        name = self.tower_name + "." + name.removeprefix(prefix)
                        break
            yield name, tensor
