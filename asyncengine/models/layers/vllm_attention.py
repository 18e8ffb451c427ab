"""vLLM's `Attention` layer, as a vLLM model file builds and calls it: `Attention(num_heads, head_size, scale,
num_kv_heads, cache_config=..., quant_config=..., prefix=...)` (this rank's heads), called as
`attn(q, k, v)` with `[tokens, heads * head_size]` projections, the step's metadata coming from the forward
context (vLLM's `get_forward_context()`), which the adapter of vLLM-shaped models sets around each forward
pass (models/vllm_model.py). It is our PagedAttention: the model runner binds its cache and backend alike.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

from asyncengine.models.layers.attention import AttentionMetadata, PagedAttention

_metadata: ContextVar[AttentionMetadata | None] = ContextVar("asyncengine_forward_metadata", default=None)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    """The step's attention metadata for the `Attention` layers called inside."""
    token = _metadata.set(metadata)
    try:
        yield
    finally:
        _metadata.reset(token)


class Attention(PagedAttention):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: Any = None, cache_config: Any = None, quant_config: Any = None,
                 logits_soft_cap: float | None = None, per_layer_sliding_window: int | None = None,
                 prefix: str = "", **extra: Any) -> None:
        if alibi_slopes is not None:
            raise ValueError(f"Attention {prefix!r}: ALiBi slopes are not supported here")
        unsupported = sorted(key for key, value in extra.items() if value not in (None, False) and key != "attn_type")
        if unsupported:
            raise ValueError(f"Attention {prefix!r}: vLLM's arguments {unsupported} are not supported here")
        found = _LAYER_INDEX.search(prefix)
        # The KV cache layout names layers by index: the decoder layer's in the prefix, else the model's order.
        super().__init__(num_heads, num_kv_heads or num_heads, head_size, scale,
                         sliding_window=per_layer_sliding_window, logits_soft_cap=logits_soft_cap,
                         layer_index=int(found.group(1)) if found else None)
        self.head_size = head_size
        self.layer_name = prefix

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                metadata: AttentionMetadata | None = None) -> torch.Tensor:
        """`query` `[tokens, heads * head_size]` (or already `[tokens, heads, head_size]`), key and value alike:
        the output `[tokens, heads * head_size]`."""
        metadata = metadata if metadata is not None else _metadata.get()
        if metadata is None:
            raise RuntimeError(f"Attention {self.layer_name!r} was called outside a forward pass: the engine sets "
                               "the step's metadata around a vLLM-shaped model's forward (models/vllm_model.py)")
        tokens = query.shape[0]
        query = query.view(tokens, self.num_heads, self.head_dim)
        key = key.view(tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(tokens, self.num_kv_heads, self.head_dim).contiguous()
        return super().forward(query, key, value, metadata)


__all__ = ["Attention", "forward_context"]
