"""The built-in attention backend "TORCH_PAGED": the paged attention of ops/paged_attention.py in plain
torch (the CPU path, and the reference other backends are checked against)."""

from __future__ import annotations

import torch

from asyncengine.attention.backend import AttentionBackend
from asyncengine.ops.paged_attention import paged_attention, store_kv


class TorchPagedBackend(AttentionBackend):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        # This step's keys and values are passed too: a prompt computed whole this step reads them
        # directly instead of gathering them back from the cache.
        return paged_attention(query, key_cache, value_cache, metadata.plan, self.scale, new_key=key, new_value=value)
