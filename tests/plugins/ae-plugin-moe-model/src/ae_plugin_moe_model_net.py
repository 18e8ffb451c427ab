"""MoeTestForCausalLM: asyncengine's Llama with each decoder layer's MLP replaced by a sparse MoE block
(a router and a FusedMoE layer, Qwen3-MoE's shape). config.json adds `num_experts`, `num_experts_per_tok`,
`moe_intermediate_size` and `norm_topk_prob`; the checkpoint names the block's parameters as the model
does (`model.layers.N.mlp.gate.weight`, `...mlp.experts.w13_weight`, `...mlp.experts.w2_weight`).

With AE_PLUGIN_RECORD naming a file, each forward pass appends a JSON line `{"what": "forward", "tokens",
"pid", "role"}`, so the test can count the MoE op's calls against the passes."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from asyncengine.plugins_api import FusedMoE, LlamaForCausalLM, current_process_role


class SparseMoeBlock(nn.Module):
    def __init__(self, config: Any, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False, dtype=dtype)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, dtype=dtype, renormalize=config.norm_topk_prob)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


class MoeTestForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, *, dtype: Any, max_position: int) -> None:
        super().__init__(config, dtype=dtype, max_position=max_position)
        for layer in self.model.layers:
            if hasattr(layer, "mlp"):
                layer.mlp = SparseMoeBlock(config, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        path = os.environ.get("AE_PLUGIN_RECORD")
        if path:
            with open(path, "a", encoding="utf-8") as record:
                record.write(json.dumps({"what": "forward", "tokens": int(input_ids.shape[0]), "pid": os.getpid(),
                                         "role": current_process_role()}) + "\n")
        return super().forward(input_ids, positions, metadata)
