"""Gemma 2: a norm before and after each block (all of Gemma's `(1 + w)` kind, applied in float32), GeGLU
(`gelu_pytorch_tanh`), embeddings scaled by sqrt(hidden_size) (rounded to the model's dtype first, as
transformers does), scores scaled by `query_pre_attn_scalar ** -0.5` and soft-capped
(`attn_logit_softcapping`), sliding-window layers alternating with full ones (`layer_types`: each type its own
KV cache groups), the logits soft-capped (`final_logit_softcapping`), the head tied to the embeddings."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncengine.models.layers.norm import GemmaRMSNorm
from asyncengine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Gemma2Attention(LlamaAttention):
    def attention_scale(self, config: Any) -> float:
        return float(config.query_pre_attn_scalar) ** -0.5

    @staticmethod
    def logits_soft_cap(config: Any) -> float | None:
        cap = getattr(config, "attn_logit_softcapping", None)
        return float(cap) if cap is not None else None


class Gemma2DecoderLayer(LlamaDecoderLayer):
    attention_cls: type[LlamaAttention] = Gemma2Attention
    norm_names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")

    @staticmethod
    def make_norm(config: Any, size: int, dtype: torch.dtype) -> nn.Module:
        return GemmaRMSNorm(size, config.rms_norm_eps, dtype=dtype)


class Gemma2Model(LlamaModel):
    layer_cls: type[LlamaDecoderLayer] = Gemma2DecoderLayer

    @staticmethod
    def embedding_scale(config: Any, dtype: torch.dtype) -> float | torch.Tensor | None:
        return torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype)


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls: type[LlamaModel] = Gemma2Model

    @staticmethod
    def final_logit_softcapping(config: Any) -> float | None:
        cap = getattr(config, "final_logit_softcapping", None)
        return float(cap) if cap is not None else None
