"""OLMoE: Llama's layer (a norm before each block) with OLMo 2's RMSNorm over the whole query projection and the
whole key projection before rotary (q_norm, k_norm; here the norm is rounded to the model dtype before its
weight multiplies, as Llama's), and a mixture of `num_experts` experts of `intermediate_size` in place of every
MLP (softmax over all experts, the top `num_experts_per_tok`, renormalised when `norm_topk_prob`, off in the
released models). `clip_qkv` (null in the released models) is refused."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from asyncengine.models.moe import SparseMoeBlock, num_experts
from asyncengine.models.olmo2 import Olmo2Attention


class OlmoeAttention(Olmo2Attention):
    llama_rounding = True

    def __init__(self, config: Any, *, dtype: torch.dtype, layer_index: int = 0) -> None:
        if getattr(config, "clip_qkv", None) is not None:
            raise ModelLoadError(f"this OLMoE config sets clip_qkv={config.clip_qkv}: clipping q/k/v is not "
                                 "supported here (the released OLMoE models leave it null)")
        super().__init__(config, dtype=dtype, layer_index=layer_index)


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = OlmoeAttention

    @staticmethod
    def make_mlp(config: Any, dtype: torch.dtype, layer_index: int) -> nn.Module:
        return SparseMoeBlock(config, dtype=dtype, num_experts=num_experts(config),
                              intermediate_size=int(config.intermediate_size),
                              renormalize=bool(getattr(config, "norm_topk_prob", False)))


class OlmoeModel(LlamaModel):
    layer_cls = OlmoeDecoderLayer


class OlmoeForCausalLM(LlamaForCausalLM):
    model_cls = OlmoeModel
