"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (a bias on q, k and v when `qkv_bias`, none on
o) with Qwen3-MoE's experts and, beside them on every sparse layer, a shared expert (a gated MLP of
`shared_expert_intermediate_size`) whose output is scaled by `sigmoid(shared_expert_gate(x))`; `norm_topk_prob`
off by default. Sliding windows follow `layer_types` (the base decoder's rule)."""

from __future__ import annotations

from typing import Any

from asyncengine.models.llama import LlamaForCausalLM, LlamaModel
from asyncengine.models.qwen2 import Qwen2Attention
from asyncengine.models.qwen3_moe import Qwen3MoeDecoderLayer


class Qwen2MoeAttention(Qwen2Attention):
    @staticmethod
    def qkv_bias(config: Any) -> bool:
        return bool(getattr(config, "qkv_bias", True))


class Qwen2MoeDecoderLayer(Qwen3MoeDecoderLayer):
    """Qwen3-MoE's layer (its experts block, `qwen_moe_mlp`, sizes the shared expert) with Qwen2's attention."""

    attention_cls = Qwen2MoeAttention


class Qwen2MoeModel(LlamaModel):
    layer_cls = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2MoeModel
