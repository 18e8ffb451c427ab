"""Qwen3: Llama's shape with an RMSNorm on each query and key head before rotary, and an explicit head_dim."""

from __future__ import annotations

from typing import Any

import torch

from asyncengine.models.layers.norm import RMSNorm
from asyncengine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, *, dtype: torch.dtype, layer_index: int = 0) -> None:
        super().__init__(config, dtype=dtype, layer_index=layer_index)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)

    def normalize_qk(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(query), self.k_norm(key)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
