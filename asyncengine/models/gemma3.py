"""Gemma 3 (text; config model_type `gemma3_text`, transformers' Gemma3TextConfig): Gemma 2's layer with an RMSNorm
of Gemma's kind on each query and key head before rotary, five sliding-window layers for each full one
(`layer_types`), and rope parameters per layer type (a local base for the sliding layers, a global base with
its own scaling for the full ones); the soft caps are off unless the config sets them."""

from __future__ import annotations

from typing import Any

import torch

from asyncengine.errors import ModelLoadError
from asyncengine.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model
from asyncengine.models.layers.norm import GemmaRMSNorm


class Gemma3Attention(Gemma2Attention):
    def __init__(self, config: Any, *, dtype: torch.dtype, layer_index: int = 0) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ModelLoadError("this Gemma 3 config sets use_bidirectional_attention (an embedding model, as "
                                 "EmbeddingGemma): Gemma3ForCausalLM here attends causally only")
        super().__init__(config, dtype=dtype, layer_index=layer_index)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)

    def normalize_qk(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(query), self.k_norm(key)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3Model(Gemma2Model):
    layer_cls = Gemma3DecoderLayer


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma3Model
