"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (an RMSNorm on each query and key head) with a
mixture of experts in place of the MLP (`num_experts` of `moe_intermediate_size`, `num_experts_per_tok` per
token: softmax over all experts, the top k, renormalised when `norm_topk_prob`), on the layers
`decoder_sparse_step` and `mlp_only_layers` make sparse (the others a dense MLP); a sliding window on every
layer when `use_sliding_window`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncengine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from asyncengine.models.mistral import MistralAttention
from asyncengine.models.moe import SparseMoeBlock, is_sparse_layer, num_experts
from asyncengine.models.qwen3 import Qwen3Attention


class Qwen3MoeAttention(Qwen3Attention):
    sliding_window = staticmethod(MistralAttention.sliding_window)  # the config sets it only when used


def qwen_moe_mlp(config: Any, dtype: torch.dtype, layer_index: int) -> nn.Module:
    """Qwen2-MoE's and Qwen3-MoE's block for a layer: the experts (with Qwen2-MoE's shared expert, where the
    config sizes one) on a sparse layer, else a dense MLP."""
    if not is_sparse_layer(config, layer_index):
        return LlamaMLP(config, dtype=dtype)
    return SparseMoeBlock(config, dtype=dtype, num_experts=num_experts(config),
                          intermediate_size=int(config.moe_intermediate_size),
                          renormalize=bool(getattr(config, "norm_topk_prob", False)),
                          shared_expert_intermediate_size=int(getattr(config, "shared_expert_intermediate_size", 0)
                                                              or 0))


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls: type[LlamaAttention] = Qwen3MoeAttention
    make_mlp = staticmethod(qwen_moe_mlp)


class Qwen3MoeModel(LlamaModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3MoeModel
