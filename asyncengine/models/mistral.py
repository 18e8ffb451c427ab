"""Mistral: Llama's shape with a sliding window on every layer (`sliding_window`; None: full attention), so its
KV cache keeps only each sequence's window (the hybrid KV cache, asyncengine/wire/kv_cache.py)."""

from __future__ import annotations

from typing import Any

from asyncengine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class MistralAttention(LlamaAttention):
    @staticmethod
    def sliding_window(config: Any, layer_index: int) -> int | None:
        window = getattr(config, "sliding_window", None)
        return int(window) if window is not None else None


class MistralDecoderLayer(LlamaDecoderLayer):
    attention_cls = MistralAttention


class MistralModel(LlamaModel):
    layer_cls = MistralDecoderLayer


class MistralForCausalLM(LlamaForCausalLM):
    model_cls = MistralModel
