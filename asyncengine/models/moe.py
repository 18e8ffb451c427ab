"""The mixture-of-experts block the MoE architectures put in place of Llama's MLP (Qwen3-MoE, Qwen2-MoE, Mixtral,
OLMoE): a router (a linear layer giving each token a logit per expert, every rank holding all of it) and the
experts (FusedMoE, asyncengine/models/layers/fused_moe.py: the routing, each expert's gated MLP, the weighted
sum, the tensor-parallel reduction), with Qwen2-MoE's shared expert and its sigmoid gate.

Checkpoint names, as transformers writes them: `mlp.gate.weight` (the router), `mlp.experts.<e>.<gate_proj|
up_proj|down_proj>.weight` (each expert; Mixtral's w1/w3/w2 under `block_sparse_moe`, renamed by its model),
`mlp.shared_expert.<gate_proj|up_proj|down_proj>.weight`, `mlp.shared_expert_gate.weight`.
The decoder's load_weights hands expert tensors to the FusedMoE layer (`load_checkpoint`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.models.layers.fused_moe import FusedMoE
from asyncengine.models.llama import LlamaMLP


class Router(nn.Module):
    """`logits = x W^T (+ b)`, W `[num_experts, hidden]`, whole on every rank (each rank routes every token)."""

    def __init__(self, hidden_size: int, num_experts: int, *, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight, self.bias)


class SparseMoeBlock(nn.Module):
    """`[tokens, hidden] -> [tokens, hidden]`: the routed experts' weighted sum, plus the shared expert's output
    (times `sigmoid(shared_expert_gate(x))`) where the architecture has one."""

    def __init__(self, config: Any, *, dtype: torch.dtype, num_experts: int, intermediate_size: int,
                 renormalize: bool, shared_expert_intermediate_size: int = 0, router_bias: bool = False,
                 experts_options: dict[str, Any] | None = None) -> None:
        """`experts_options`: more of FusedMoE's settings (GPT-OSS: routing, activation, has_bias, ...)."""
        super().__init__()
        hidden = config.hidden_size
        self.gate = Router(hidden, num_experts, bias=router_bias, dtype=dtype)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: Router | None = None
        if shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config, dtype=dtype, intermediate_size=shared_expert_intermediate_size)
            self.shared_expert_gate = Router(hidden, 1, bias=False, dtype=dtype)
        self.experts = FusedMoE(num_experts, int(config.num_experts_per_tok), hidden, intermediate_size, dtype=dtype,
                                renormalize=renormalize, shared_expert=self.shared_expert,
                                shared_expert_gate=self.shared_expert_gate, **(experts_options or {}))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


def num_experts(config: Any) -> int:
    """The config's expert count: `num_experts` (Qwen-MoE, OLMoE checkpoints) or `num_local_experts` (Mixtral,
    GPT-OSS, and what transformers 5 writes for all of them)."""
    value = getattr(config, "num_experts", None)
    return int(value if value is not None else getattr(config, "num_local_experts", 0) or 0)


def is_sparse_layer(config: Any, layer_index: int) -> bool:
    """Qwen2-MoE's and Qwen3-MoE's rule: a layer is a MoE layer unless `mlp_only_layers` lists it, every
    `decoder_sparse_step`-th layer (1: all of them); the others keep a dense MLP of `intermediate_size`."""
    if layer_index in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return num_experts(config) > 0 and (layer_index + 1) % step == 0
