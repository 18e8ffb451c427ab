"""OLMo 2: norms on each block's output only (post_attention_layernorm, post_feedforward_layernorm; none before),
an RMSNorm over the whole query projection and the whole key projection before rotary (q_norm, k_norm), every
norm applying its weight in float32 before the rounding to the model's dtype."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncengine import parallel_state as parallel
from asyncengine.models.layers.linear import check_shape, copy_checked, set_weight_attrs
from asyncengine.models.layers.norm import GemmaRMSNorm, rms_norm_float32_weight, rms_norm_native
from asyncengine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def olmo2_norm(config: Any, size: int, dtype: torch.dtype) -> GemmaRMSNorm:
    return GemmaRMSNorm(size, config.rms_norm_eps, dtype=dtype, weight_offset=0.0)


class ProjectionNorm(GemmaRMSNorm):
    """OLMo 2's norm of a whole projection, whose rows tensor-parallel ranks split: each rank holds its rows of
    the weight, and the mean square is summed over the ranks (`replicas`: how many ranks hold each row, when a
    KV head is repeated on several). `llama_rounding`: round the norm to the model dtype before the weight
    multiplies (OLMoE's, Llama's order) instead of after (OLMo 2's)."""

    def __init__(self, total: int, rows: tuple[int, int], eps: float, *, dtype: torch.dtype, replicas: int,
                 llama_rounding: bool = False) -> None:
        super().__init__(rows[1] - rows[0], eps, dtype=dtype, weight_offset=0.0)
        self.total, self.rows, self.replicas = total, rows, replicas
        self.llama_rounding = llama_rounding
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """The whole projection's norm weight: this rank's rows of it."""
        name = f"{type(self).__name__} weight"
        check_shape(loaded_weight, (self.total,), name)
        copy_checked(param.data, loaded_weight.narrow(0, self.rows[0], self.rows[1] - self.rows[0]), name)

    def forward_native(self, x: torch.Tensor,
                       residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            raise ValueError("ProjectionNorm normalizes a projection: it takes no residual")
        if parallel.world_size() == 1:
            if self.llama_rounding:
                return rms_norm_native(x, self.weight, self.eps)
            return rms_norm_float32_weight(x, self.effective_weight(), self.eps)
        h = x.float()
        square_sum = parallel.all_reduce(h.pow(2).sum(-1, keepdim=True)) / self.replicas
        h = h * torch.rsqrt(square_sum / self.total + self.eps)
        if self.llama_rounding:
            return self.weight * h.to(x.dtype)
        return (h * self.effective_weight()).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    llama_rounding = False  # ProjectionNorm's rounding order (OLMoE: True)

    def __init__(self, config: Any, *, dtype: torch.dtype, layer_index: int = 0) -> None:
        super().__init__(config, dtype=dtype, layer_index=layer_index)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        kv_replicas = max(1, parallel.world_size() // kv_heads)  # ranks sharing each KV head (partition_heads)
        self.q_norm = ProjectionNorm(heads * self.head_dim, self.q_rows, config.rms_norm_eps, dtype=dtype, replicas=1,
                                     llama_rounding=self.llama_rounding)
        self.k_norm = ProjectionNorm(kv_heads * self.head_dim, self.kv_rows, config.rms_norm_eps, dtype=dtype,
                                     replicas=kv_replicas, llama_rounding=self.llama_rounding)

    def normalize_qk(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = query.shape[0]
        return (self.q_norm(query.reshape(tokens, -1)).view(query.shape),
                self.k_norm(key.reshape(tokens, -1)).view(key.shape))


class Olmo2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Olmo2Attention
    norm_names = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")
    make_norm = staticmethod(olmo2_norm)


class Olmo2Model(LlamaModel):
    layer_cls = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model
