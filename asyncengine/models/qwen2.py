"""Qwen2: Llama's shape with a bias on the q, k and v projections (and none on o)."""

from __future__ import annotations

from typing import Any

from asyncengine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def qkv_bias(config: Any) -> bool:
        return True

    @staticmethod
    def o_bias(config: Any) -> bool:
        return False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2Model(LlamaModel):
    layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2Model
