"""Granite: Llama's shape with four multipliers: on the embeddings (`embedding_multiplier`), on each block's output
before it joins the residual (`residual_multiplier`), as the attention scale (`attention_multiplier`, in place of
head_dim ** -0.5) and as a divisor of the logits (`logits_scaling`)."""

from __future__ import annotations

from typing import Any

import torch

from asyncengine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GraniteAttention(LlamaAttention):
    def attention_scale(self, config: Any) -> float:
        return float(config.attention_multiplier)


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_cls = GraniteAttention

    @staticmethod
    def block_output_multiplier(config: Any) -> float | None:
        return float(config.residual_multiplier)


class GraniteModel(LlamaModel):
    layer_cls = GraniteDecoderLayer

    @staticmethod
    def embedding_scale(config: Any, dtype: torch.dtype) -> float | torch.Tensor | None:
        return float(config.embedding_multiplier)  # a Python number, as transformers multiplies


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls = GraniteModel

    @staticmethod
    def logits_scaling(config: Any) -> float | None:
        return float(config.logits_scaling)
