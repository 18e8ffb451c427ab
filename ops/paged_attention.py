"""Paged attention in plain torch: the reference every kernel is checked against, and the CPU path.

Layout. The KV cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.
A batch is a flat run of tokens: sequence `b` owns query rows `query_start_loc[b]:query_start_loc[b+1]`,
and after this step its context (cached prefix plus the new tokens) is `seq_lens[b]` tokens long, held
in the blocks listed in row `b` of `block_tables`. New tokens are always the last of their context, so
query row `i` of sequence `b` sits at position `seq_lens[b] - query_len + i` and sees keys up to there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value to its slot (`block_id * block_size + offset`)."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: `[length, num_kv_heads, head_dim]`."""
    return cache[block_ids].flatten(0, 1)[:length]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    *,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of `query` `[num_tokens, num_heads, head_dim]` over each sequence's paged context.

    `query_lens` and `seq_lens` are host lists (one entry per sequence). When `new_key`/`new_value`
    (this step's keys and values, already stored in the cache) are given, a sequence whose whole
    context is new this step reads them directly instead of gathering them back from the cache.
    Returns `[num_tokens, num_heads, head_dim]`.
    """
    output = torch.empty_like(query)
    block_size = key_cache.shape[1]
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    start = 0
    for seq_index, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        if query_len == 1:
            decode_rows.append(start)
            decode_seqs.append(seq_index)
        else:
            rows = slice(start, start + query_len)
            if new_key is not None and query_len == seq_len:
                keys, values = new_key[rows], new_value[rows]
            else:
                blocks = block_tables[seq_index, : -(-seq_len // block_size)]
                keys = gather_context(key_cache, blocks, seq_len)
                values = gather_context(value_cache, blocks, seq_len)
            output[rows] = _prefill_attention(query[rows], keys, values, scale)
        start += query_len
    if decode_rows:
        output[decode_rows] = _decode_attention(
            query[decode_rows], key_cache, value_cache, block_tables[decode_seqs],
            [seq_lens[i] for i in decode_seqs], scale,
        )
    return output


def _prefill_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    query_len, context_len = query.shape[0], keys.shape[0]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, dim]
    k = keys.transpose(0, 1).unsqueeze(0)
    v = values.transpose(0, 1).unsqueeze(0)
    if query_len == context_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Queries are the last query_len positions of the context (bottom-right aligned causal mask).
        offset = context_len - query_len
        rows = torch.arange(query_len, device=query.device).unsqueeze(1)
        cols = torch.arange(context_len, device=query.device).unsqueeze(0)
        mask = cols <= rows + offset
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """One query per sequence: gather every context padded to the longest, mask the padding."""
    block_size = key_cache.shape[1]
    num_blocks = -(-max(seq_lens) // block_size)
    tables = block_tables[:, :num_blocks]
    keys = key_cache[tables].flatten(1, 2).transpose(1, 2)  # [batch, kv_heads, padded_len, dim]
    values = value_cache[tables].flatten(1, 2).transpose(1, 2)
    lengths = torch.tensor(seq_lens, device=query.device)
    mask = torch.arange(keys.shape[2], device=query.device).unsqueeze(0) < lengths.unsqueeze(1)
    q = query.unsqueeze(2)  # [batch, heads, 1, dim]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    return out.squeeze(2)
