"""The attention layer of every model: hands this step's queries, keys and values to its backend.

The model runner binds each layer's cache (`kv_cache`) once it allocates the cache, and its backend
(`backend`: the attention backend the platform chose, asyncengine/attention/) once the model is
loaded; it passes the step's `AttentionMetadata` through the model's forward.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncengine.interfaces.attention import AttentionBackend
from asyncengine.ops.paged_attention import AttentionPlan, plan_attention


class AttentionMetadata:
    """Where this step's tokens go and what each sequence attends to (see ops/paged_attention.py).

    The model runner builds one per step, shared by every layer. What it holds:
    - `slot_mapping` `[num_tokens]` int64: cache slot of each new token (negative: store nothing, for the
      padding rows of a captured CUDA graph);
    - `query_lens`, `seq_lens`: per sequence, tokens computed this step and its context length after it,
      as Python lists (already at hand on the host; a graph-safe backend must not read them, see below);
    - `block_tables` `[num_seqs, max_blocks]` int64 on the device;
    - the same batch as device tensors, for kernels that must not wait for a host copy:
      `query_start_loc` `[num_seqs + 1]` int32 (where each sequence's rows start, then the total) and
      `seq_lens_tensor` `[num_seqs]` int32; `max_query_len`, `max_seq_len` as ints (`max_seq_len` is None
      in a captured decode graph: the kernel then takes its grid from the width of `block_tables`);
    - `decode_only`: every sequence has exactly one new token this step;
    - `plan`: the torch path's per-step plan, worked out on first use (only TORCH_PAGED reads it), so
      a step on another backend does not pay for it.

    With several KV cache groups (sliding-window layers, asyncengine/wire/kv_cache.py), each group's
    sequences have their own block tables, hence their own slots: `group_metadata[g]` is group g's
    metadata (the same batch), and each attention layer reads its group's (`for_group`).
    """

    def __init__(self, slot_mapping: torch.Tensor, plan: AttentionPlan | None, query_lens: list[int],
                 seq_lens: list[int], block_tables: torch.Tensor, *, block_size: int | None = None,
                 query_start_loc: torch.Tensor | None = None, seq_lens_tensor: torch.Tensor | None = None,
                 max_query_len: int | None = None, max_seq_len: int | None = None,
                 decode_only: bool | None = None) -> None:
        self.slot_mapping = slot_mapping
        self._plan = plan
        self.query_lens = query_lens
        self.seq_lens = seq_lens
        self.block_tables = block_tables
        self.block_size = block_size
        device = block_tables.device
        if query_start_loc is None:
            starts = [0]
            for n in query_lens:
                starts.append(starts[-1] + n)
            query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
        if seq_lens_tensor is None:
            seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.query_start_loc = query_start_loc
        self.seq_lens_tensor = seq_lens_tensor
        self.max_query_len = max(query_lens, default=0) if max_query_len is None else max_query_len
        self.max_seq_len: int | None = max(seq_lens, default=0) if max_seq_len is None else max_seq_len
        self.decode_only = (bool(query_lens) and all(n == 1 for n in query_lens)) if decode_only is None \
            else decode_only
        self.group_metadata: list[AttentionMetadata] | None = None  # per KV cache group, when there are several

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV cache group `group` (this one for the first group, or a model of one group)."""
        if group == 0 or self.group_metadata is None:
            return self
        return self.group_metadata[group]

    @property
    def plan(self) -> AttentionPlan:
        if self._plan is None:
            if self.block_size is None:
                raise RuntimeError("AttentionMetadata was built without a plan and without block_size; "
                                   "pass block_size= so the torch path can plan the step")
            self._plan = plan_attention(self.query_lens, self.seq_lens, self.block_tables, self.block_size)
        return self._plan


class PagedAttention(nn.Module):
    """One decoder layer's attention over the paged KV cache.

    `sliding_window`: each query sees only its last `sliding_window` keys (Mistral, Gemma 2/3's local
    layers); the KV cache then keeps only those blocks for this layer (the hybrid KV cache). `logits_soft_cap`:
    scores capped as `cap * tanh(score / cap)` before the softmax (Gemma 2). `sinks`: a logit per query head (of
    this rank) that joins each row's softmax and attends to nothing (GPT-OSS); the model owns the tensor (its
    checkpoint name is the model's), this layer only hands it to the backend. `layer_index`: the layer's place in
    the model (the KV cache layout names layers by it; with pipeline parallelism a stage holds only some).
    """

    sinks: torch.Tensor | None

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 sinks: torch.Tensor | None = None, layer_index: int | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "sinks", sinks)  # a reference, not a parameter of this module
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.layer_index = layer_index
        self.kv_cache_group = 0  # set by the model runner from the KV cache layout
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.backend: AttentionBackend | None = None

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`query` `[tokens, heads, head_dim]`, `key`/`value` `[tokens, kv_heads, head_dim]`."""
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError("attention layer has no KV cache or backend bound: the model runner must bind them")
        if self.kv_cache_group:
            metadata = metadata.for_group(self.kv_cache_group)
        return self.backend.forward(query, key, value, self.kv_cache, metadata).flatten(1)
