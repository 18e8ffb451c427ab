"""Mixtral: Mistral's decoder (a sliding window on every layer when `sliding_window` is set) with a mixture of
`num_local_experts` experts of `intermediate_size` in place of every MLP, `num_experts_per_tok` per token (softmax
over all experts, the top k, always renormalised). The checkpoint names the block `block_sparse_moe` and each
expert's projections w1 (gate), w3 (up), w2 (down); they load as `mlp` (FusedMoE reads w1/w3/w2)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from asyncengine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from asyncengine.models.mistral import MistralAttention
from asyncengine.models.moe import SparseMoeBlock, num_experts


class MixtralDecoderLayer(LlamaDecoderLayer):
    attention_cls = MistralAttention

    @staticmethod
    def make_mlp(config: Any, dtype: torch.dtype, layer_index: int) -> nn.Module:
        return SparseMoeBlock(config, dtype=dtype, num_experts=num_experts(config),
                              intermediate_size=int(config.intermediate_size), renormalize=True)


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor
