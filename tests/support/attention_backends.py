"""Attention backends for tests, named by class path (no registration needed): one that delegates to the
built-in and counts its calls, and a class that is no backend."""

from __future__ import annotations

from asyncengine.interfaces.attention import AttentionBackend
from asyncengine.attention.torch_paged import TorchPagedBackend


class CountingBackend(AttentionBackend):
    calls = 0  # forward calls in this process, all layers

    def __init__(self, num_heads, num_kv_heads, head_dim, scale):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.inner = TorchPagedBackend(num_heads, num_kv_heads, head_dim, scale)

    def forward(self, query, key, value, kv_cache, metadata):
        type(self).calls += 1
        return self.inner.forward(query, key, value, kv_cache, metadata)


class NotABackend:
    pass
