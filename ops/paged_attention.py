"""Paged attention in plain torch: the reference every kernel is checked against, and the CPU path.

Layout. The KV cache of one layer is two tensors `[num_kv_heads, num_blocks, block_size, head_dim]`:
head-major, so that gathering a sequence's blocks yields, per head, its keys as one contiguous
`[tokens, head_dim]` matrix that a matmul reads directly (no transpose copy).

A batch is a flat run of tokens: sequence `b` owns `query_lens[b]` consecutive query rows, and after
this step its context (cached prefix plus the new tokens) is `seq_lens[b]` tokens long, held in the
blocks listed in row `b` of `block_tables`. New tokens are always the last of their context, so
query row `i` of sequence `b` sits at position `seq_lens[b] - query_lens[b] + i` and sees keys up to there.

Everything that depends only on the batch (which sequences decode, how they group, their masks) is
worked out once per step by `plan_attention` and shared by every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Decoding sequences are attended in groups of similar length, each padded only to its own longest.
DECODE_GROUP_SIZE = 8


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [n] query rows, one per sequence
    block_tables: torch.Tensor  # [n, blocks] enough blocks for the longest member
    padding: torch.Tensor  # [1, n, 1, blocks * block_size] True where a slot is past a member's context
    lengths: torch.Tensor  # [n] each member's context length
    # gather_rows(block_tables, ...) for the cache shape seen by the first layer, reused by the others
    cache_rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def rows_in(self, cache: torch.Tensor) -> torch.Tensor:
        key = (cache.shape[0], cache.shape[1])
        rows = self.cache_rows.get(key)
        if rows is None:
            rows = self.cache_rows[key] = gather_rows(self.block_tables, *key)
        return rows


@dataclass
class PrefillSequence:
    start: int  # first query row
    query_len: int
    seq_len: int
    block_table: torch.Tensor  # [1, blocks]
    index: int  # its row of the step's block tables

    @property
    def causal_mask(self) -> torch.Tensor | None:
        """`[query_len, seq_len]` when part of the context is cached (bottom-right aligned: query i sees keys
        up to seq_len - query_len + i), else None. Built when the torch reference asks: an in-place kernel
        needs none."""
        if self.query_len == self.seq_len:
            return None
        return self.mask()

    def mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """`[query_len, seq_len]`, True where query i sees key j: causal (bottom-right aligned), and with a
        sliding window only the last `sliding_window` keys up to its own position (transformers'
        `kv_idx > q_idx - sliding_window`)."""
        device = self.block_table.device
        rows = torch.arange(self.query_len, device=device).unsqueeze(1) + (self.seq_len - self.query_len)
        cols = torch.arange(self.seq_len, device=device).unsqueeze(0)
        visible = cols <= rows
        if sliding_window is not None:
            visible &= cols > rows - sliding_window
        return visible


class AttentionPlan:
    """The step's prefills, and its decoding sequences: grouped for the torch reference
    (`decode_groups`, built on first use) or listed per query row for an in-place kernel (`query_index`)."""

    def __init__(self, block_tables: torch.Tensor, block_size: int) -> None:
        self.block_tables = block_tables
        self.block_size = block_size
        self.prefills: list[PrefillSequence] = []
        self.decoding: list[tuple[int, int, int]] = []  # (seq_len, query row, sequence index)
        self._decode_groups: list[DecodeGroup] | None = None
        self._query_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def decode_groups(self) -> list[DecodeGroup]:
        if self._decode_groups is None:
            self._decode_groups = _group_decodes(self.decoding, self.block_tables, self.block_size)
        return self._decode_groups

    @property
    def query_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per query row, prefill rows included: its sequence's row of `block_tables` and the query row
        (int64), and how many tokens of the context it sees (int32). A prefill row is a causal query like
        a decode: row i of a prefill sees its context up to its own position."""
        if self._query_index is None:
            seqs = [d[2] for d in self.decoding]
            rows = [d[1] for d in self.decoding]
            lens = [d[0] for d in self.decoding]
            for seq in self.prefills:
                cached = seq.seq_len - seq.query_len
                seqs += [seq.index] * seq.query_len
                rows += range(seq.start, seq.start + seq.query_len)
                lens += range(cached + 1, seq.seq_len + 1)
            device = self.block_tables.device
            self._query_index = (torch.tensor(seqs, dtype=torch.int64, device=device),
                                 torch.tensor(rows, dtype=torch.int64, device=device),
                                 torch.tensor(lens, dtype=torch.int32, device=device))
        return self._query_index


def plan_attention(
    query_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int
) -> AttentionPlan:
    plan = AttentionPlan(block_tables, block_size)
    start = 0
    for index, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        blocks = -(-seq_len // block_size)
        if query_len == 1:
            plan.decoding.append((seq_len, start, index))
        else:
            plan.prefills.append(PrefillSequence(start, query_len, seq_len, block_tables[index : index + 1, :blocks],
                                                 index))
        start += query_len
    return plan


def _group_decodes(decoding: list[tuple[int, int, int]], block_tables: torch.Tensor,
                   block_size: int) -> list[DecodeGroup]:
    device = block_tables.device
    groups = []
    decoding = sorted(decoding)
    for first in range(0, len(decoding), DECODE_GROUP_SIZE):
        members = decoding[first : first + DECODE_GROUP_SIZE]
        lengths = torch.tensor([m[0] for m in members], device=device)
        blocks = -(-members[-1][0] // block_size)
        padding = torch.arange(blocks * block_size, device=device) >= lengths.unsqueeze(1)
        groups.append(
            DecodeGroup(
                rows=torch.tensor([m[1] for m in members], device=device),
                block_tables=block_tables[[m[2] for m in members], :blocks],
                padding=padding[None, :, None, :],
                lengths=lengths,
            )
        )
    return groups


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's `[num_kv_heads, head_dim]` key and value to its slot (`block_id * block_size + offset`)."""
    num_kv_heads, _, _, head_dim = key_cache.shape
    key_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
    value_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The blocks of each row of `block_tables` `[seqs, blocks]`, as `[num_kv_heads, seqs, blocks * block_size, head_dim]`.

    One `index_select` over a 2-D view of the cache: on CPU it copies whole blocks and runs several
    times faster than advanced indexing of the 4-D tensor. `rows` (from `gather_rows`) may be passed
    when several layers gather the same blocks.
    """
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    num_seqs, blocks_per_seq = block_tables.shape
    if rows is None:
        rows = gather_rows(block_tables, num_kv_heads, num_blocks)
    gathered = cache.view(num_kv_heads * num_blocks, block_size * head_dim).index_select(0, rows)
    return gathered.view(num_kv_heads, num_seqs, blocks_per_seq * block_size, head_dim)


def gather_rows(block_tables: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Row indices, in the 2-D view `[num_kv_heads * num_blocks, ...]` of a cache, of the given blocks."""
    head_offsets = torch.arange(num_kv_heads, device=block_tables.device).view(-1, 1, 1) * num_blocks
    return (block_tables.unsqueeze(0) + head_offsets).flatten()


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    *,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
    in_place: Callable[..., None] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of `query` `[num_tokens, num_heads, head_dim]` over each sequence's paged context;
    with `sliding_window`, each query sees only the last `sliding_window` keys up to its own position (the
    blocks before them are never read: a sliding layer's cache holds only its window, see the hybrid KV
    cache in docs/engine.md); with `logits_soft_cap`, scores are capped as `cap * tanh(score / cap)` before
    the softmax (Gemma 2); with `sinks` `[num_heads]`, each head's sink logit joins every row's softmax and
    its share of the probability goes to no value (GPT-OSS).

    When `new_key`/`new_value` (this step's keys and values, already stored in the cache) are given,
    a sequence whose whole context is new this step reads them directly instead of gathering them
    back from the cache. `in_place(query, key_cache, value_cache, plan, scale, output, sliding_window=...,
    logits_soft_cap=..., sinks=...)`, when given, writes every row of `output` at once, prefills and decodes alike,
    reading the cache pages where they lie (an in-place kernel, cpu_attention.py); without it, prefills run through
    torch's scaled_dot_product_attention (explicitly, with a soft cap) and decodes grouped through the torch
    reference. Returns `[num_tokens, num_heads, head_dim]`.
    """
    output = torch.empty_like(query)
    if in_place is not None:
        if plan.prefills or plan.decoding:
            in_place(query, key_cache, value_cache, plan, scale, output, sliding_window=sliding_window,
                     logits_soft_cap=logits_soft_cap, sinks=sinks)
        return output
    for seq in plan.prefills:
        rows = slice(seq.start, seq.start + seq.query_len)
        windowed = sliding_window is not None and sliding_window < seq.seq_len
        mask = seq.mask(sliding_window) if windowed else seq.causal_mask
        if new_key is not None and seq.query_len == seq.seq_len:
            keys, values = new_key[rows], new_value[rows]
        else:
            # A sliding layer's blocks before the earliest window are freed: gather from the first one in use.
            first = (seq.seq_len - seq.query_len - sliding_window + 1) // key_cache.shape[2] if windowed else 0
            first = max(first, 0)
            start = first * key_cache.shape[2]
            keys = gather_blocks(key_cache, seq.block_table[:, first:])[:, 0, : seq.seq_len - start].transpose(0, 1)
            values = gather_blocks(value_cache, seq.block_table[:, first:])[:, 0, : seq.seq_len - start].transpose(0, 1)
            if mask is not None:
                mask = mask[:, start:]
        output[rows] = _prefill_attention(query[rows], keys, values, mask, scale, logits_soft_cap, sinks)
    for group in plan.decode_groups:
        output[group.rows] = _decode_attention(query[group.rows], key_cache, value_cache, group, scale,
                                               sliding_window, logits_soft_cap, sinks)
    return output


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's attention (and final-logit) soft cap, as transformers computes it: `tanh(s / cap) * cap`."""
    return torch.tanh(scores / cap) * cap


def _prefill_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
    logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`query` `[query_len, heads, dim]` over `keys`/`values` `[context_len, kv_heads, dim]`; `mask`
    `[query_len, context_len]` (True: visible), None meaning causal from the first key."""
    q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, dim]
    k = keys.transpose(0, 1).unsqueeze(0)
    v = values.transpose(0, 1).unsqueeze(0)
    if logits_soft_cap is not None or sinks is not None:  # between the product and the softmax: no fused kernel
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if logits_soft_cap is not None:
            scores = soft_cap(scores, logits_soft_cap)
        if mask is None:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(_softmax_with_sinks(scores.float(), sinks, scores.shape[1]).to(v.dtype), v)
    elif mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _decode_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: DecodeGroup, scale: float,
    sliding_window: int | None = None, logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence, `[n, heads, dim]`. Query heads are grouped under their KV head
    (`[kv_heads, n, heads_per_kv_head, dim]`), so GQA needs no copy of the keys per query head. With a
    sliding window the keys before it are masked (the torch reference gathers them anyway: a stale or null
    block there holds finite values, zeroed at allocation)."""
    num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[3]
    num_seqs = query.shape[0]
    rows = group.rows_in(key_cache)
    keys = gather_blocks(key_cache, group.block_tables, rows)  # [kv_heads, n, padded_len, dim]
    values = gather_blocks(value_cache, group.block_tables, rows)
    q = query.view(num_seqs, num_kv_heads, -1, head_dim).transpose(0, 1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [kv_heads, n, heads_per_kv_head, padded_len]
    if logits_soft_cap is not None:
        scores = soft_cap(scores, logits_soft_cap)
    scores.masked_fill_(group.padding, float("-inf"))
    if sliding_window is not None:
        before = torch.arange(keys.shape[2], device=keys.device) < (group.lengths - sliding_window).unsqueeze(1)
        scores.masked_fill_(before[None, :, None, :], float("-inf"))
    if sinks is None:
        probabilities = torch.softmax(scores, dim=-1)
    else:  # each query head's sink: heads are [kv_heads, heads_per_kv_head] here
        probabilities = _softmax_with_sinks(scores.transpose(1, 2), sinks, num_kv_heads * scores.shape[2])
        probabilities = probabilities.transpose(1, 2).to(scores.dtype)
    out = torch.matmul(probabilities, values)
    return out.transpose(0, 1).reshape(num_seqs, -1, head_dim)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor:
    """Softmax over the last dimension of `scores`, whose leading dimensions flatten to the query heads in order
    (`[..., heads..., rows, keys]`), with each head's sink logit as one more column, dropped after the softmax
    (its probability attends to nothing). In the scores' dtype (float32 where transformers computes it so)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    shape = scores.shape
    flat = scores.reshape(num_heads, -1, shape[-1])
    sink = sinks.to(flat.dtype).view(num_heads, 1, 1).expand(num_heads, flat.shape[1], 1)
    combined = torch.cat([flat, sink], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1].reshape(shape)
