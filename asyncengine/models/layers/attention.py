"""The attention layer of every model: store this step's keys and values, attend over the pages.

The model runner binds each layer's cache (`kv_cache`) once, after it allocates the cache, and passes
the step's `AttentionMetadata` through the model's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asyncengine.ops.paged_attention import AttentionPlan, paged_attention, store_kv


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what each sequence attends to (see ops/paged_attention.py)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    plan: AttentionPlan  # built once per step, shared by every layer


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`query` `[tokens, heads, head_dim]`, `key`/`value` `[tokens, kv_heads, head_dim]`."""
        if self.kv_cache is None:
            raise RuntimeError("attention layer has no KV cache bound: the model runner must bind it first")
        key_cache, value_cache = self.kv_cache
        store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        out = paged_attention(
            query, key_cache, value_cache, metadata.plan, self.scale, new_key=key, new_value=value
        )
        return out.flatten(1)
