"""GLM-4 (the 0414 models): a norm before and after each block (input_layernorm, post_self_attn_layernorm around
attention; post_attention_layernorm, post_mlp_layernorm around the MLP), a bias on q/k/v but not on o, gate/up
stored fused in the checkpoint, and GPT-J's interleaved rotation on the first half of each head
(`partial_rotary_factor` 0.5)."""

from __future__ import annotations

from typing import Any

from asyncengine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Glm4Attention(LlamaAttention):
    @staticmethod
    def o_bias(config: Any) -> bool:
        return False


class Glm4DecoderLayer(LlamaDecoderLayer):
    attention_cls = Glm4Attention
    norm_names = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


class Glm4Model(LlamaModel):
    layer_cls = Glm4DecoderLayer

    @staticmethod
    def rope_parameters(config: Any, key: str | None) -> dict[str, Any]:
        return {**LlamaModel.rope_parameters(config, key), "is_neox_style": False}


class Glm4ForCausalLM(LlamaForCausalLM):
    model_cls = Glm4Model
