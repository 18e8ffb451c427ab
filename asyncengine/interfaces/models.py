"""ModelRegistry: architecture name (config.json's `architectures`) -> model class.

Built-in models register here in code, so the engine works from a source tree with no installed
metadata. A class may be given lazily as "package.module:Class"; it is imported when first needed,
and an import error is raised with its traceback (never remembered as "unsupported").
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from asyncengine.errors import ModelLoadError, UnsupportedArchitectureError
from asyncengine.interfaces.imports import import_by_path
from asyncengine.interfaces.registry import BUILT_IN, Registry


@runtime_checkable
class ModelClass(Protocol):
    """What a model registry entry (and a `model_class_overrides` class) is: a class built as
    `Class(hf_config)` that loads its weights (asyncengine/models/llama.py is the model interface)."""

    def load_weights(self, weights: Any) -> Any: ...


class _ModelRegistry(Registry[type[ModelClass]]):
    def __init__(self) -> None:
        super().__init__("models", "model architecture", ModelClass,
                         expected="a model class with load_weights(weights) (asyncengine.models.llama's interface)")
        for architecture, path in {
            "LlamaForCausalLM": "asyncengine.models.llama:LlamaForCausalLM",
            "Qwen2ForCausalLM": "asyncengine.models.qwen2:Qwen2ForCausalLM",
            "Qwen3ForCausalLM": "asyncengine.models.qwen3:Qwen3ForCausalLM",
            "MistralForCausalLM": "asyncengine.models.mistral:MistralForCausalLM",
            "Gemma2ForCausalLM": "asyncengine.models.gemma2:Gemma2ForCausalLM",
            "Gemma3ForCausalLM": "asyncengine.models.gemma3:Gemma3ForCausalLM",
            "Phi3ForCausalLM": "asyncengine.models.phi3:Phi3ForCausalLM",
            "Olmo2ForCausalLM": "asyncengine.models.olmo2:Olmo2ForCausalLM",
            "GraniteForCausalLM": "asyncengine.models.granite:GraniteForCausalLM",
            "Glm4ForCausalLM": "asyncengine.models.glm4:Glm4ForCausalLM",
            # Mixtures of experts (docs/models.md): the decoder above with a FusedMoE block (models/moe.py).
            "Qwen3MoeForCausalLM": "asyncengine.models.qwen3_moe:Qwen3MoeForCausalLM",
            "Qwen2MoeForCausalLM": "asyncengine.models.qwen2_moe:Qwen2MoeForCausalLM",
            "MixtralForCausalLM": "asyncengine.models.mixtral:MixtralForCausalLM",
            "OlmoeForCausalLM": "asyncengine.models.olmoe:OlmoeForCausalLM",
            "GptOssForCausalLM": "asyncengine.models.gpt_oss:GptOssForCausalLM",
            # Images and text (docs/multimodal.md): an image tower beside a language model above.
            "Qwen2VLForConditionalGeneration": "asyncengine.models.qwen2_vl:Qwen2VLForConditionalGeneration",
            "Qwen2_5_VLForConditionalGeneration": "asyncengine.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
            "Gemma3ForConditionalGeneration": "asyncengine.models.gemma3_mm:Gemma3ForConditionalGeneration",
            # Pooling models (docs/pooling.md): BERT-family encoders and classifiers on BERT and decoder bases.
            "BertModel": "asyncengine.models.bert:BertModel",
            "BertForSequenceClassification": "asyncengine.models.bert:BertForSequenceClassification",
            "XLMRobertaModel": "asyncengine.models.bert:XLMRobertaModel",
            "XLMRobertaForSequenceClassification": "asyncengine.models.bert:XLMRobertaForSequenceClassification",
            "LlamaForSequenceClassification": "asyncengine.models.pooling_adapters:LlamaForSequenceClassification",
            "Qwen2ForSequenceClassification": "asyncengine.models.pooling_adapters:Qwen2ForSequenceClassification",
            "Qwen3ForSequenceClassification": "asyncengine.models.pooling_adapters:Qwen3ForSequenceClassification",
            # Vision-language models (docs/multimodal.md): a vision tower in front of the Llama path.
            "Idefics3ForConditionalGeneration": "asyncengine.models.idefics3:Idefics3ForConditionalGeneration",
            "SmolVLMForConditionalGeneration": "asyncengine.models.idefics3:SmolVLMForConditionalGeneration",
            "LlavaForConditionalGeneration": "asyncengine.models.llava:LlavaForConditionalGeneration",
        }.items():
            self.register(architecture, path, owner=BUILT_IN)

    def register_model(self, architecture: str, model: Any, *, override: bool = False,
                       is_multimodal: bool | None = None) -> None:
        """Register `model` (a class, or "package.module:Class") under `architecture` (vLLM's name).
        `is_multimodal` is taken for vLLM's plugins and not needed: whether a model takes images is read from
        its class (SupportsMultiModal, MULTIMODAL_REGISTRY) and its config.json (docs/multimodal.md)."""
        self.register(architecture, model, override=override)

    def get_supported_archs(self) -> list[str]:
        return self.keys()

    def is_supported(self, architecture: str) -> bool:
        return architecture in self

    def resolve(self, architectures: list[str], overrides: dict[str, str] | None = None) -> tuple[str, type]:
        """The first of `architectures` that has a class (config-given overrides win), and that class."""
        overrides = overrides or {}
        for architecture in architectures:
            override = overrides.get(architecture)
            if override is not None:  # a config hook, checked in the config-hooks phase
                return architecture, import_by_path(override, what=f"model class for {architecture}",
                                                    error=ModelLoadError)
            if architecture in self:
                return architecture, self.load(architecture)
        raise UnsupportedArchitectureError(
            f"model architecture(s) {', '.join(architectures) or '(none given)'} are not supported for now; "
            f"supported: {', '.join(self.get_supported_archs())}"
        )


ModelRegistry = _ModelRegistry()


__all__ = ["ModelClass", "ModelRegistry"]
