"""EXAMPLE_SDPA: the attention backend the example platform chooses, an implementation of its own.

Per sequence of the batch it writes the step's keys and values into their cache slots, gathers the
sequence's whole context back from its blocks (block table -> slots), and calls torch's
`scaled_dot_product_attention` with a causal mask offset by the context already cached. Simpler and
slower than the built-in TORCH_PAGED (one call per sequence, no decode batching); the same numbers up
to float rounding. Each instance counts its calls, and the first call in a process is recorded with the
process id and role: the worker runs the model, so that is where it must run.
"""

from __future__ import annotations

from typing import Any

from asyncengine.plugins_api import AttentionBackend

from ae_platform_example.record import record

_recorded_in_this_process = False


class ExampleSdpaBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.calls = 0

    def forward(self, query: Any, key: Any, value: Any, kv_cache: tuple[Any, Any], metadata: Any) -> Any:
        import torch
        import torch.nn.functional as F

        global _recorded_in_this_process
        if not _recorded_in_this_process:
            _recorded_in_this_process = True
            record("attention forward", backend=type(self).__qualname__)
        self.calls += 1
        key_cache, value_cache = kv_cache
        num_kv_heads, _, block_size, head_dim = key_cache.shape
        keys = key_cache.view(num_kv_heads, -1, head_dim)  # [kv_heads, slots, head_dim], a view of the cache
        values = value_cache.view(num_kv_heads, -1, head_dim)
        keys.index_copy_(1, metadata.slot_mapping, key.transpose(0, 1))
        values.index_copy_(1, metadata.slot_mapping, value.transpose(0, 1))

        group = self.num_heads // self.num_kv_heads  # query heads per key/value head (GQA)
        offsets = torch.arange(block_size, device=query.device)
        output = torch.empty_like(query)
        start = 0
        for index, (query_len, seq_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens)):
            num_blocks = -(-seq_len // block_size)
            blocks = metadata.block_tables[index, :num_blocks]
            slots = (blocks[:, None] * block_size + offsets).flatten()[:seq_len]
            context_keys = keys.index_select(1, slots).repeat_interleave(group, dim=0)  # [heads, seq_len, dim]
            context_values = values.index_select(1, slots).repeat_interleave(group, dim=0)
            queries = query[start:start + query_len].transpose(0, 1)  # [heads, query_len, dim]
            # Query j sits at position seq_len - query_len + j and sees the keys up to it.
            positions = torch.arange(seq_len - query_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= positions[:, None]
            attended = F.scaled_dot_product_attention(queries, context_keys, context_values, attn_mask=mask,
                                                      scale=self.scale)
            output[start:start + query_len] = attended.transpose(0, 1)
            start += query_len
        return output
