"""Paged attention in Triton: a decode kernel split over the context (flash-decoding), and a prefill
kernel for a flat batch of variable-length queries over their cached prefixes (causal).

Same cache layout, batch description and result as the torch reference, ops/paged_attention.py:
caches `[num_kv_heads, num_blocks, block_size, head_dim]`, `block_tables` `[num_seqs, max_blocks]`,
`seq_lens` the context length of each sequence after this step, one query row per sequence.

Why split the context: a decode step has one query per sequence, so one program per (sequence,
KV head) leaves most of a GPU idle when the batch is small and the contexts long. Each program here
takes one (sequence, KV head, context split) and attends its query heads (the GQA group of that KV
head, so each key is loaded once for all of them) over a run of whole blocks of the split; it writes
the split's running max, its softmax sum and its normalised output. `_combine_splits` then weights
the splits by their log-sum-exp in torch: a few element-wise ops over a small tensor.

The kernel reduces with broadcast products and `tl.sum` rather than `tl.dot`: a decode group has
few query heads (often 2-8, under `tl.dot`'s minimum of 16 rows), and it runs under the interpreter.
All arithmetic is in fp32 whatever the cache dtype; the output takes the query's dtype.

The prefill kernel takes one (sequence, query head, tile of 16 query rows) per program and walks the
context blocks up to the tile's last row with an online softmax; any mix of whole prompts, chunks after
a cached prefix and single-token decodes goes in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Aim for about this many programs per step when choosing how many splits a context gets: enough to
# fill the SMs of a large GPU several times, few enough that the combine stays cheap.
TARGET_PROGRAMS = 512


@triton.jit
def _decode_split_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    max_ptr, sum_ptr, out_ptr,
    scale,
    stride_q_token, stride_q_head,
    stride_k_head, stride_k_block, stride_k_slot,
    stride_v_head, stride_v_block, stride_v_slot,
    stride_bt_seq,
    num_heads, num_splits,
    HEADS_PER_KV: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    # int64: kv_head * stride_k_head spans the whole cache of a layer, which may pass 2**31 elements.
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    heads = tl.arange(0, GROUP)
    dims = tl.arange(0, HEAD_DIM_P)
    slots = tl.arange(0, BLOCK_SIZE)
    head_ok = heads < HEADS_PER_KV
    dim_ok = dims < HEAD_DIM
    q_heads = kv_head * HEADS_PER_KV + heads  # query heads of this KV head (GQA: consecutive)

    q = tl.load(query_ptr + seq * stride_q_token + q_heads[:, None] * stride_q_head + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    q = q * scale

    m = tl.full([GROUP], float("-inf"), tl.float32)
    l = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, HEAD_DIM_P], tl.float32)

    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    first = split * BLOCKS_PER_SPLIT
    last = tl.minimum(first + BLOCKS_PER_SPLIT, num_blocks)
    for logical in range(first, last):
        block = tl.load(block_tables_ptr + seq * stride_bt_seq + logical).to(tl.int64)
        positions = logical * BLOCK_SIZE + slots
        slot_ok = positions < seq_len
        kv_mask = slot_ok[:, None] & dim_ok[None, :]
        k = tl.load(key_cache_ptr + kv_head * stride_k_head + block * stride_k_block
                    + slots[:, None] * stride_k_slot + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + kv_head * stride_v_head + block * stride_v_block
                    + slots[:, None] * stride_v_slot + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP, BLOCK_SIZE]
        scores = tl.where(slot_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        # Each block holds at least one valid slot (last <= num_blocks), so m_new is finite here.
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    # An empty split (past this sequence's context) keeps m = -inf, l = 0, output 0: weight 0 below.
    out = acc / tl.maximum(l, 1e-30)[:, None]
    part = (seq * num_heads + q_heads) * num_splits + split  # [GROUP] index into [seqs, heads, splits]
    tl.store(max_ptr + part, m, mask=head_ok)
    tl.store(sum_ptr + part, l, mask=head_ok)
    tl.store(out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=head_ok[:, None] & dim_ok[None, :])


@triton.jit
def _prefill_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_starts_ptr, query_lens_ptr, seq_lens_ptr,
    out_ptr,
    scale,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_k_head, stride_k_block, stride_k_slot,
    stride_v_head, stride_v_block, stride_v_slot,
    stride_bt_seq,
    HEADS_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """One (sequence, query head, tile of BLOCK_M query rows): causal attention over the paged context,
    query row i sitting at position seq_len - query_len + i (the new tokens are the context's last)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    query_len = tl.load(query_lens_ptr + seq)
    if tile * BLOCK_M < query_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        start = tl.load(query_starts_ptr + seq)
        kv_head = (head // HEADS_PER_KV).to(tl.int64)  # int64: see the decode kernel
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM_P)
        slots = tl.arange(0, BLOCK_SIZE)
        row_ok = rows < query_len
        dim_ok = dims < HEAD_DIM
        positions_q = seq_len - query_len + rows  # [BLOCK_M]
        q = tl.load(query_ptr + (start + rows)[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32) * scale

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
        # Keys past the tile's last row are masked for all of its rows: stop at that row's block.
        last_position = tl.minimum(seq_len - query_len + tile * BLOCK_M + BLOCK_M, seq_len)
        for logical in range(0, tl.cdiv(last_position, BLOCK_SIZE)):
            block = tl.load(block_tables_ptr + seq * stride_bt_seq + logical).to(tl.int64)
            positions_k = logical * BLOCK_SIZE + slots
            kv_mask = (positions_k < seq_len)[:, None] & dim_ok[None, :]
            k = tl.load(key_cache_ptr + kv_head * stride_k_head + block * stride_k_block
                        + slots[:, None] * stride_k_slot + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(value_cache_ptr + kv_head * stride_v_head + block * stride_v_block
                        + slots[:, None] * stride_v_slot + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_M, BLOCK_SIZE]
            visible = (positions_k[None, :] <= positions_q[:, None]) & (positions_k < seq_len)[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            # A row that sees nothing yet in this block keeps m_new = -inf: shift by 0 instead (no NaN).
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - shift)
            p = tl.exp(scores - shift[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new

        out = acc / tl.maximum(l, 1e-30)[:, None]
        tl.store(out_ptr + (start + rows)[:, None] * stride_o_token + head * stride_o_head + dims[None, :],
                 out, mask=row_ok[:, None] & dim_ok[None, :])


def choose_blocks_per_split(num_seqs: int, num_kv_heads: int, max_blocks: int,
                            target_programs: int = TARGET_PROGRAMS) -> int:
    """Blocks per split so that seqs x kv_heads x splits is near `target_programs` (at least 1 block)."""
    splits = max(1, target_programs // max(1, num_seqs * num_kv_heads))
    return max(1, -(-max_blocks // splits))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    blocks_per_split: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence, `query` `[num_seqs, num_heads, head_dim]`, over the paged
    context of `seq_lens[b]` tokens held in the blocks of `block_tables[b]`. Returns (or fills `out`)
    `[num_seqs, num_heads, head_dim]` in the query's dtype.

    `max_seq_len` (the largest of `seq_lens`, when the caller has it as a Python int) spares a device
    sync; `blocks_per_split` overrides the split size chosen by `choose_blocks_per_split`.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    _check_shapes("paged_decode_attention", query, key_cache, value_cache)
    if query.stride(2) != 1:
        query = query.contiguous()
    if seq_lens.shape != (num_seqs,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"paged_decode_attention: {num_seqs} queries, but seq_lens {tuple(seq_lens.shape)} and "
                         f"block_tables {tuple(block_tables.shape)}")
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    max_blocks = -(-max_seq_len // block_size)
    if blocks_per_split is None:
        blocks_per_split = choose_blocks_per_split(num_seqs, num_kv_heads, max_blocks)
    num_splits = max(1, -(-max_blocks // blocks_per_split))

    heads_per_kv = num_heads // num_kv_heads
    partial_max = torch.empty(num_seqs, num_heads, num_splits, device=query.device, dtype=torch.float32)
    partial_sum = torch.empty_like(partial_max)
    partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, device=query.device, dtype=torch.float32)
    grid = (num_seqs, num_kv_heads, num_splits)
    _decode_split_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens,
        partial_max, partial_sum, partial_out,
        float(scale),
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        num_heads, num_splits,
        HEADS_PER_KV=heads_per_kv, GROUP=triton.next_power_of_2(heads_per_kv),
        HEAD_DIM=head_dim, HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCKS_PER_SPLIT=blocks_per_split,
    )
    out.copy_(_combine_splits(partial_max, partial_sum, partial_out))
    return out


def _combine_splits(partial_max: torch.Tensor, partial_sum: torch.Tensor, partial_out: torch.Tensor) -> torch.Tensor:
    """Merge the splits `[seqs, heads, splits(, dim)]`: each split's normalised output weighted by its share
    `sum_s * exp(max_s - max)` of the whole softmax. Split 0 is never empty, so the total is positive."""
    overall = partial_max.amax(dim=-1, keepdim=True)
    weights = partial_sum * torch.exp(partial_max - overall)  # empty splits: 0 * exp(-inf) = 0
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights.unsqueeze(-1) * partial_out).sum(dim=-2)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_m: int = 16,
) -> torch.Tensor:
    """Causal attention of a flat batch `query` `[num_tokens, num_heads, head_dim]`: sequence `b` owns
    `query_lens[b]` consecutive rows, the last tokens of its `seq_lens[b]`-token context (a cached prefix
    before them), held in the blocks of `block_tables[b]`. Any mix of prompts, chunks and decodes."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    _check_shapes("paged_prefill_attention", query, key_cache, value_cache)
    if len(query_lens) != len(seq_lens) or len(seq_lens) != block_tables.shape[0] or sum(query_lens) != num_tokens:
        raise ValueError(f"paged_prefill_attention: {len(query_lens)} query_lens summing to {sum(query_lens)}, "
                         f"{len(seq_lens)} seq_lens and block_tables {tuple(block_tables.shape)} for {num_tokens} "
                         "query rows; they must describe the same sequences and every row")
    if any(q > s or q < 1 for q, s in zip(query_lens, seq_lens)):
        raise ValueError(f"paged_prefill_attention: query_lens {query_lens} must be 1..seq_len ({seq_lens})")
    if query.stride(2) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    starts = [0]
    for n in query_lens[:-1]:
        starts.append(starts[-1] + n)

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=query.device)

    grid = (len(seq_lens), num_heads, -(-max(query_lens) // block_m))
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, as_tensor(starts), as_tensor(query_lens), as_tensor(seq_lens),
        out,
        float(scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        HEADS_PER_KV=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m,
    )
    return out


def _check_shapes(what: str, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, _, block_size, cache_dim = key_cache.shape
    if value_cache.shape != key_cache.shape or cache_dim != head_dim:
        raise ValueError(f"{what}: key cache {tuple(key_cache.shape)}, value cache "
                         f"{tuple(value_cache.shape)} and query {tuple(query.shape)} disagree; both caches must be "
                         "[num_kv_heads, num_blocks, block_size, head_dim] with the query's head_dim")
    if num_heads % num_kv_heads:
        raise ValueError(f"{what}: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if block_size & (block_size - 1):
        raise ValueError(f"{what}: block size {block_size} is not a power of two; "
                         "use the torch path (ops/paged_attention.py) for this cache")
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError(f"{what}: the caches' head_dim must be contiguous")


__all__ = ["choose_blocks_per_split", "paged_decode_attention", "paged_prefill_attention"]
