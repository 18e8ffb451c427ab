"""The attention layer of every model: hands this step's queries, keys and values to its backend.

The model runner binds each layer's cache (`kv_cache`) once it allocates the cache, and its backend
(`backend`: the attention backend the platform chose, asyncengine/attention/) once the model is
loaded; it passes the step's `AttentionMetadata` through the model's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asyncengine.attention.backend import AttentionBackend
from asyncengine.ops.paged_attention import AttentionPlan


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what each sequence attends to (see ops/paged_attention.py)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    plan: AttentionPlan  # built once per step, shared by every layer
    # The batch as plain data, for backends that plan their own way (already at hand: no extra work).
    query_lens: list[int]  # per sequence: tokens computed this step
    seq_lens: list[int]  # per sequence: context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, on the device


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.backend: AttentionBackend | None = None

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`query` `[tokens, heads, head_dim]`, `key`/`value` `[tokens, kv_heads, head_dim]`."""
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError("attention layer has no KV cache or backend bound: the model runner must bind them")
        return self.backend.forward(query, key, value, self.kv_cache, metadata).flatten(1)
