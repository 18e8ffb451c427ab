"""AttentionBackend: the interface every attention backend implements (the built-in one included).

The worker builds one instance per attention layer, once the model is loaded, with that layer's shape.
Every step the layer calls `forward` with the step's queries, keys and values, its KV cache and the
step's metadata; the backend stores the new keys and values in the cache and attends. What it is given:

- `query` `[num_tokens, num_heads, head_dim]`; `key`, `value` `[num_tokens, num_kv_heads, head_dim]`
  (rotary already applied), in the batch's flat token order;
- `kv_cache`: `(key_cache, value_cache)`, each `[num_kv_heads, num_blocks, block_size, head_dim]`, zeroed
  at allocation; the model runner owns the layout, so a backend reads and writes it as it is;
- `metadata` (`asyncengine.models.layers.attention.AttentionMetadata`): `slot_mapping` (cache slot of
  each new token: `block_id * block_size + offset`), `query_lens` and `seq_lens` (per sequence: tokens
  new this step, and its context length after it), `block_tables` `[num_seqs, max_blocks]` int64 on the
  device, and `plan` (the torch path's per-step plan, shared by all layers).

It returns `[num_tokens, num_heads, head_dim]`: row `i` is token `i`'s causal attention over its own
sequence's context. No torch import here: `asyncengine.plugins_api` exports this class without torch.
"""

from __future__ import annotations

from typing import Any


class AttentionBackend:
    """Subclass it, implement `forward`, and register the class (or its "pkg.mod:Class" path) with
    `register_attention_backend("NAME", ...)` from a general plugin."""

    # Set True only if, in a decode step (`metadata.decode_only`), `forward` reads nothing of the
    # metadata but its device tensors (`slot_mapping`, `block_tables`, `seq_lens_tensor`,
    # `query_start_loc`), sizes every launch from shapes (`metadata.max_seq_len` is None then), skips
    # negative slots and writes finite output for rows whose `seq_lens_tensor` is 0: the model runner
    # may then replay decode steps from CUDA graphs (asyncengine/worker/cuda_graphs.py).
    cuda_graph_safe = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, query: Any, key: Any, value: Any, kv_cache: tuple[Any, Any], metadata: Any) -> Any:
        raise NotImplementedError(f"{type(self).__qualname__} must implement "
                                  "forward(query, key, value, kv_cache, metadata)")
