"""Paged attention in Triton: a decode kernel split over the context (flash-decoding), and a prefill
kernel for a flat batch of variable-length queries over their cached prefixes (causal, `tl.dot`).

Same cache layout, batch description and result as the torch reference, ops/paged_attention.py:
caches `[num_kv_heads, num_blocks, block_size, head_dim]`, `block_tables` `[num_seqs, max_blocks]`,
`seq_lens` the context length of each sequence after this step; the new tokens are each context's last.

Both entry points take the batch description as device tensors and size their launch from shapes and
Python ints only: no host sync, no copy to the device, no allocation that depends on device values, so
a runner can call them with the tensors it already holds, and capture the decode in a CUDA graph.

Decode. A decode step has one query per sequence, so one program per (sequence, KV head) leaves most
of a GPU idle when the batch is small and the contexts long. Each program takes one (sequence, KV head,
context split) and attends its query heads (the GQA group of that KV head, so each key is loaded once
for all of them) over a run of whole blocks of the split; it writes the split's running max, softmax
sum and normalised output, which `_combine_kernel` weights by their log-sum-exp (one small launch).
With one split (a large batch) the program writes the output itself and nothing is combined. The
decode kernel reduces with broadcast products and `tl.sum`: a decode group has few query heads (often
2-8), under the 16 rows `tl.dot` needs.

Decode tiles. A decode is bound by memory bandwidth: each program streams its keys and values once. One
16-token block an iteration is a 4 KB K tile and a 4 KB V tile in bf16 at head_dim 128, too few bytes in
flight per program to approach an H200's bandwidth, so each iteration takes a tile of TILE_TOKENS keys,
several whole cache blocks (`decode_tile_tokens`): their block ids are read from the block table per key
and each key is gathered from its own block, so the blocks of a tile may lie anywhere in the cache. The
tile is the largest power of two up to 128 keys whose product group x keys x head_dim stays within 16K
fp32 elements (the broadcast product lives in registers): 64 keys (4 blocks of 16, 16 KB of K and of V
in bf16) at W1's shape, 128 for smaller heads, down to one block for wide groups; never less than one
block. Keys past the context in the last tile, and past the split's end, are masked, their block-table
entries included. A split is any number of whole blocks; the chosen split size is a whole number of
tiles. num_warps=4, num_stages=2 (so the next tile's loads can overlap this one's math). These choices
follow the usual reasoning for memory-bound kernels and are unmeasured until a GPU run (issue 7's
bench/gpu.py); `tile_tokens=` lets that run compare tiles.

Prefill. One program per (sequence, tile of query tokens, KV head): the tile's rows are its tokens times
the KV head's query heads (the GQA group, stacked so each key block is loaded once for the group), and
it walks the context in blocks of BLOCK_N keys with an online softmax, `tl.dot` for QK^T and PV (tensor
cores on the GPU). Key blocks every row of the tile sees run without a causal mask; only the last ones,
up to the tile's last position, are masked. Any mix of whole prompts, chunks after a cached prefix and
single-token decodes goes in one launch.

Accumulation is fp32 whatever the cache dtype; the output takes the query's dtype (or `out`'s).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Aim for about this many programs per step when choosing how many splits a context gets: enough to
# fill the SMs of a large GPU several times, few enough that the combine stays cheap.
TARGET_PROGRAMS = 512
# The decode kernel's tile (see "Decode tiles" above): at most this many keys an iteration, and at most
# this many elements in its broadcast product GQA group x keys x head_dim (fp32, in registers).
MAX_TILE_TOKENS = 128
TILE_ELEMENTS = 16384

# How the prefill kernel's tl.dot runs: half precision as is; fp32 with "ieee" (exact products, not
# TF32, so it matches the fp32 reference); bf16 under the interpreter upcast to fp32 first, because the
# interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584, not supported there).
_DOT_NATIVE, _DOT_IEEE, _DOT_UPCAST = 0, 1, 2
# Triton decides at decoration (this module's import) whether kernels are interpreted; so does this.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _decode_split_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    max_ptr, sum_ptr, part_out_ptr, out_ptr,
    scale,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_k_head, stride_k_block, stride_k_slot,
    stride_v_head, stride_v_block, stride_v_slot,
    stride_bt_seq,
    num_heads, num_splits,
    HEADS_PER_KV: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_TOKENS: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
):
    """One (sequence, KV head, split): the split's blocks, TILE_TOKENS keys (TILE_TOKENS // BLOCK_SIZE
    whole cache blocks) an iteration, each key fetched through its own block-table entry."""
    seq = tl.program_id(0)
    # int64: kv_head * stride_k_head spans the whole cache of a layer, which may pass 2**31 elements.
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    heads = tl.arange(0, GROUP)
    dims = tl.arange(0, HEAD_DIM_P)
    tile = tl.arange(0, TILE_TOKENS)
    head_ok = heads < HEADS_PER_KV
    dim_ok = dims < HEAD_DIM
    q_heads = kv_head * HEADS_PER_KV + heads  # query heads of this KV head (GQA: consecutive)

    q = tl.load(query_ptr + seq * stride_q_token + q_heads[:, None] * stride_q_head + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    q = q * scale

    m = tl.full([GROUP], float("-inf"), tl.float32)
    l = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, HEAD_DIM_P], tl.float32)

    # A row of seq_len 0 (padding in a captured batch) has no blocks: it reads nothing, and writes zeros.
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    first = split * BLOCKS_PER_SPLIT
    last = tl.minimum(first + BLOCKS_PER_SPLIT, num_blocks)
    # Keys at or past `end` belong to the next split or lie past the context. The split's last tile may
    # run past both (a context ending mid-tile or mid-block, or a split of a number of blocks that is
    # not a multiple of the tile's): those keys are masked, and so are their block-table entries, which
    # are never read past the sequence's last block.
    end = tl.minimum(last * BLOCK_SIZE, seq_len)
    k_base = key_cache_ptr + kv_head * stride_k_head
    v_base = value_cache_ptr + kv_head * stride_v_head
    bt_row = block_tables_ptr + seq * stride_bt_seq
    for start in range(first, last, TILE_TOKENS // BLOCK_SIZE):  # whole blocks a tile
        positions = start * BLOCK_SIZE + tile
        key_ok = positions < end
        # The tile's block ids, one per key (consecutive keys share one: the loads of one block's id
        # coalesce), then each key's row in its own block: the tile gathers from scattered blocks.
        blocks = tl.load(bt_row + positions // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slots = positions % BLOCK_SIZE
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_base + (blocks * stride_k_block + slots * stride_k_slot)[:, None] + dims[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)  # [TILE_TOKENS, HEAD_DIM_P]
        v = tl.load(v_base + (blocks * stride_v_block + slots * stride_v_slot)[:, None] + dims[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP, TILE_TOKENS]
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        # A tile's first key is always valid (start < last <= num_blocks), so m_new is finite here.
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    # An empty split (past this sequence's context) keeps m = -inf, l = 0, output 0: weight 0 when combined.
    out = acc / tl.maximum(l, 1e-30)[:, None]
    out_mask = head_ok[:, None] & dim_ok[None, :]
    if SINGLE_SPLIT:
        tl.store(out_ptr + seq * stride_o_token + q_heads[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (seq * num_heads + q_heads) * num_splits + split  # [GROUP] index into [seqs, heads, splits]
        tl.store(max_ptr + part, m, mask=head_ok)
        tl.store(sum_ptr + part, l, mask=head_ok)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)


@triton.jit
def _combine_kernel(
    max_ptr, sum_ptr, part_out_ptr, out_ptr,
    stride_o_token, stride_o_head,
    num_heads, num_splits,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    """One (sequence, query head): merge its splits with a running max, as the softmax over the whole
    context would have weighted them. All splits empty (a padding row): zeros."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    base = (seq * num_heads + head) * num_splits
    m = tl.full([], float("-inf"), tl.float32)  # tensors, not Python floats: they are loop-carried
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM_P], tl.float32)
    for split in range(0, num_splits):
        m_split = tl.load(max_ptr + base + split)
        sum_split = tl.load(sum_ptr + base + split)
        out_split = tl.load(part_out_ptr + (base + split) * HEAD_DIM + dims, mask=dim_ok, other=0.0)
        m_new = tl.maximum(m, m_split)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no -inf - -inf
        weight = sum_split * tl.exp(m_split - shift)  # an empty split: 0 * exp(-inf) = 0
        rescale = tl.exp(m - shift)
        acc = acc * rescale + weight * out_split
        total = total * rescale + weight
        m = m_new
    out = acc / tl.maximum(total, 1e-30)
    tl.store(out_ptr + seq * stride_o_token + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_ok)


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    if DOT == 2:  # _DOT_UPCAST
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif DOT == 1:  # _DOT_IEEE
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _prefill_key_block(
    acc, l, m, q, start_n, positions_q, seq_len, qk_scale,
    k_base, v_base, bt_row, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
    dims, dim_ok,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT: tl.constexpr,
):
    """One step of the online softmax over the keys at positions start_n .. start_n + BLOCK_N - 1.
    MASKED: the block may hold keys past the context or past some rows' positions (the causal edge)."""
    positions_k = start_n + tl.arange(0, BLOCK_N)
    # Each key's cache block (a BLOCK_N run may span several cache blocks, or part of one).
    if MASKED:
        key_ok = positions_k < seq_len
        blocks = tl.load(bt_row + positions_k // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        k_mask = dim_ok[:, None] & key_ok[None, :]
        v_mask = key_ok[:, None] & dim_ok[None, :]
    else:
        blocks = tl.load(bt_row + positions_k // BLOCK_SIZE).to(tl.int64)
        k_mask = dim_ok[:, None]
        v_mask = dim_ok[None, :]
    slots = positions_k % BLOCK_SIZE
    k_t = tl.load(k_base + (blocks * stride_k_block + slots * stride_k_slot)[None, :] + dims[:, None],
                  mask=k_mask, other=0.0)  # [HEAD_DIM_P, BLOCK_N]: K transposed, for q @ k_t
    v = tl.load(v_base + (blocks * stride_v_block + slots * stride_v_slot)[:, None] + dims[None, :],
                mask=v_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_P]
    scores = _dot(q, k_t, DOT) * qk_scale  # [BLOCK_M, BLOCK_N], in log2 units
    if MASKED:
        visible = (positions_k[None, :] <= positions_q[:, None]) & key_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    if MASKED:
        # A row that has seen no key yet keeps m_new = -inf: shift by 0 instead (no -inf - -inf = NaN).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        shift = m_new
    alpha = tl.math.exp2(m - shift)
    p = tl.math.exp2(scores - shift[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT)
    return acc, l, m_new


@triton.jit
def _prefill_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr,
    qk_scale,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_k_head, stride_k_block, stride_k_slot,
    stride_v_head, stride_v_block, stride_v_slot,
    stride_bt_seq,
    HEADS_PER_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT: tl.constexpr,
):
    """One (sequence, tile of BLOCK_Q query tokens, KV head); BLOCK_M = BLOCK_Q * GROUP rows. Row r of the
    tile is token r // GROUP and query head r % GROUP of the KV head's group; query token i of a sequence
    sits at position seq_len - query_len + i. Programs past their sequence's query length exit."""
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2).to(tl.int64)  # int64: see the decode kernel
    start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - start
    if tile * BLOCK_Q < query_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - query_len  # the cached prefix before this step's tokens
        rows = tl.arange(0, BLOCK_M)
        tokens = tile * BLOCK_Q + rows // GROUP  # index among this sequence's query tokens
        group_heads = rows % GROUP
        dims = tl.arange(0, HEAD_DIM_P)
        row_ok = (tokens < query_len) & (group_heads < HEADS_PER_KV)
        dim_ok = dims < HEAD_DIM
        heads = kv_head * HEADS_PER_KV + group_heads
        positions_q = context_len + tokens
        q = tl.load(query_ptr + (start + tokens).to(tl.int64)[:, None] * stride_q_token
                    + heads[:, None] * stride_q_head + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
        k_base = key_cache_ptr + kv_head * stride_k_head
        v_base = value_cache_ptr + kv_head * stride_v_head
        bt_row = block_tables_ptr + seq * stride_bt_seq
        # Keys up to the tile's first position are seen by all its rows: whole BLOCK_N runs of them go
        # unmasked. The rest, up to the tile's last position (or the context's end), take the mask.
        first_position = context_len + tile * BLOCK_Q
        full_end = (tl.maximum(first_position + 1, 0) // BLOCK_N) * BLOCK_N
        end = tl.minimum(first_position + BLOCK_Q, seq_len)
        for start_n in range(0, full_end, BLOCK_N):
            acc, l, m = _prefill_key_block(acc, l, m, q, start_n, positions_q, seq_len, qk_scale,
                                           k_base, v_base, bt_row, stride_k_block, stride_k_slot,
                                           stride_v_block, stride_v_slot, dims, dim_ok,
                                           BLOCK_SIZE, BLOCK_N, False, DOT)
        for start_n in range(full_end, end, BLOCK_N):
            acc, l, m = _prefill_key_block(acc, l, m, q, start_n, positions_q, seq_len, qk_scale,
                                           k_base, v_base, bt_row, stride_k_block, stride_k_slot,
                                           stride_v_block, stride_v_slot, dims, dim_ok,
                                           BLOCK_SIZE, BLOCK_N, True, DOT)

        out = acc / tl.maximum(l, 1e-30)[:, None]
        tl.store(out_ptr + (start + tokens).to(tl.int64)[:, None] * stride_o_token
                 + heads[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def decode_tile_tokens(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Keys the decode kernel takes an iteration: the largest power of two up to MAX_TILE_TOKENS whose
    broadcast product (GQA group x keys x padded head_dim) stays within TILE_ELEMENTS, never less than
    one cache block (so a tile is whole blocks: block_size 16, W1's group of 2 at head_dim 128 -> 64)."""
    group = triton.next_power_of_2(num_heads // num_kv_heads)
    tokens = max(1, TILE_ELEMENTS // (group * triton.next_power_of_2(head_dim)))
    tokens = min(MAX_TILE_TOKENS, 1 << (tokens.bit_length() - 1))  # round down to a power of two
    return max(block_size, tokens)


def choose_blocks_per_split(num_seqs: int, num_kv_heads: int, max_blocks: int,
                            target_programs: int = TARGET_PROGRAMS, tile_blocks: int = 1) -> int:
    """Blocks per split so that seqs x kv_heads x splits is near `target_programs` (at least 1 block),
    rounded up to whole tiles of `tile_blocks` blocks, so that no split ends inside a tile."""
    splits = max(1, target_programs // max(1, num_seqs * num_kv_heads))
    blocks = max(1, -(-max_blocks // splits))
    return -(-blocks // tile_blocks) * tile_blocks


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
    tile_tokens: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence, `query` `[num_seqs, num_heads, head_dim]`, over the paged
    context of `seq_lens[b]` tokens (int32 or int64 on the query's device) held in the blocks of
    `block_tables[b]`. Returns (or fills `out`) `[num_seqs, num_heads, head_dim]` in the query's dtype.

    The launch depends on shapes only, so the call can be captured in a CUDA graph with static buffers:
    without `max_seq_len` the splits cover the whole width of `block_tables` (programs past a context's
    end exit at once). `max_seq_len`, a Python int bound on `seq_lens`, narrows them. A row with
    seq_len 0 (padding) reads no cache and comes out as zeros. `blocks_per_split` overrides the split
    size chosen by `choose_blocks_per_split` (any number of blocks: a split ending inside a tile masks
    the rest of it), `tile_tokens` the keys an iteration chosen by `decode_tile_tokens` (a power of two,
    at least the block size).
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    _check_shapes("paged_decode_attention", query, key_cache, value_cache, block_tables, out)
    if seq_lens.shape != (num_seqs,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"paged_decode_attention: {num_seqs} queries, but seq_lens {tuple(seq_lens.shape)} and "
                         f"block_tables {tuple(block_tables.shape)}; pass one seq_len and one block-table row "
                         "per query row (pad both for padding rows, with seq_len 0)")
    _check_index_tensor("paged_decode_attention", "seq_lens", seq_lens, query.device)
    table_len = block_tables.shape[1] * block_size
    if max_seq_len is None:
        max_seq_len = table_len
    elif not 0 <= max_seq_len <= table_len:
        raise ValueError(f"paged_decode_attention: max_seq_len {max_seq_len} is outside 0..{table_len}, what "
                         f"block_tables of {block_tables.shape[1]} blocks of {block_size} can hold; pass the "
                         "largest seq_len, or None to cover the whole table")
    if blocks_per_split is not None and blocks_per_split < 1:
        raise ValueError(f"paged_decode_attention: blocks_per_split {blocks_per_split} must be at least 1")
    if tile_tokens is None:
        tile_tokens = decode_tile_tokens(block_size, num_heads, num_kv_heads, head_dim)
    elif tile_tokens < block_size or tile_tokens & (tile_tokens - 1):
        raise ValueError(f"paged_decode_attention: tile_tokens {tile_tokens} must be a power of two of at least "
                         f"the block size {block_size} (a tile is whole cache blocks)")
    if query.stride(2) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    max_blocks = max(1, -(-max_seq_len // block_size))
    if blocks_per_split is None:
        blocks_per_split = choose_blocks_per_split(num_seqs, num_kv_heads, max_blocks,
                                                   tile_blocks=tile_tokens // block_size)
    num_splits = max(1, -(-max_blocks // blocks_per_split))

    heads_per_kv = num_heads // num_kv_heads
    if num_splits == 1:
        partial_max = partial_sum = partial_out = out  # unused: the kernel writes `out` itself
    else:
        partial_max = torch.empty(num_seqs, num_heads, num_splits, device=query.device, dtype=torch.float32)
        partial_sum = torch.empty_like(partial_max)
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, device=query.device,
                                  dtype=torch.float32)
    grid = (num_seqs, num_kv_heads, num_splits)
    _decode_split_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens,
        partial_max, partial_sum, partial_out, out,
        float(scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        num_heads, num_splits,
        HEADS_PER_KV=heads_per_kv, GROUP=triton.next_power_of_2(heads_per_kv),
        HEAD_DIM=head_dim, HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, TILE_TOKENS=tile_tokens, BLOCKS_PER_SPLIT=blocks_per_split,
        SINGLE_SPLIT=num_splits == 1,
        num_warps=4, num_stages=2,  # see "Decode tiles" in the module docstring: unmeasured
    )
    if num_splits > 1:
        _combine_kernel[(num_seqs, num_heads)](
            partial_max, partial_sum, partial_out, out, out.stride(0), out.stride(1), num_heads, num_splits,
            HEAD_DIM=head_dim, HEAD_DIM_P=triton.next_power_of_2(head_dim),
        )
    return out


def _combine_splits(partial_max: torch.Tensor, partial_sum: torch.Tensor, partial_out: torch.Tensor) -> torch.Tensor:
    """What `_combine_kernel` computes, in torch (its reference in the tests). Merge the splits
    `[seqs, heads, splits(, dim)]`: each split's normalised output weighted by its share
    `sum_s * exp(max_s - max)` of the whole softmax. A row whose splits are all empty (seq_len 0, a
    padding row) has max -inf and sum 0 everywhere: it takes weight 0 throughout and comes out as zeros."""
    overall = partial_max.amax(dim=-1, keepdim=True)
    overall = torch.where(torch.isinf(overall), torch.zeros_like(overall), overall)  # all empty: no -inf - -inf
    weights = partial_sum * torch.exp(partial_max - overall)  # empty splits: 0 * exp(-inf) = 0
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return (weights.unsqueeze(-1) * partial_out).sum(dim=-2)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of a flat batch `query` `[num_tokens, num_heads, head_dim]`: sequence `b` owns
    rows `query_start_loc[b] .. query_start_loc[b + 1] - 1` (`query_start_loc` int32 `[num_seqs + 1]`,
    cumulative query lengths from 0, on the query's device), the last tokens of its `seq_lens[b]`-token
    context (`seq_lens` int32 `[num_seqs]` on the device; a cached prefix before them), held in the
    blocks of `block_tables[b]`. Any mix of prompts, chunks and decodes. Returns (or fills `out`).

    `max_query_len` (a Python int, at least the longest query of the batch) sizes the launch with the
    number of sequences and heads; nothing is read back from the device. Rows past a larger bound are
    skipped by their programs; rows past a smaller one would be left unwritten, so it must not be less.
    `block_m` (rows of a tile: query tokens x the GQA group) and `block_n` (keys per step) tune the tiles:
    powers of two, at least 16.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    what = "paged_prefill_attention"
    _check_shapes(what, query, key_cache, value_cache, block_tables, out)
    num_seqs = block_tables.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or seq_lens.shape != (num_seqs,):
        raise ValueError(f"{what}: block_tables has {num_seqs} rows, but query_start_loc "
                         f"{tuple(query_start_loc.shape)} and seq_lens {tuple(seq_lens.shape)}; pass "
                         f"query_start_loc [{num_seqs + 1}] (cumulative query lengths from 0) and seq_lens "
                         f"[{num_seqs}], one entry per sequence")
    _check_index_tensor(what, "query_start_loc", query_start_loc, query.device)
    _check_index_tensor(what, "seq_lens", seq_lens, query.device)
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"{what}: max_query_len must be a Python int >= 0 (the longest query of the batch, "
                         f"known to the host), not {max_query_len!r}")
    if num_tokens and max_query_len == 0:
        raise ValueError(f"{what}: max_query_len is 0 for {num_tokens} query rows; pass the longest query length")
    heads_per_kv = num_heads // num_kv_heads
    group = triton.next_power_of_2(heads_per_kv)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dim >= 16
    if block_m is None:
        block_m = max(64, group)
    if block_n is None:
        block_n = 64 if query.dtype != torch.float32 and head_dim_p <= 128 else 32  # shared memory
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{what}: {name} {value} must be a power of two >= 16 (tl.dot's minimum)")
    if block_m < group:
        raise ValueError(f"{what}: block_m {block_m} is smaller than the GQA group of {heads_per_kv} query heads "
                         f"per KV head (padded to {group}); pass at least {group}")
    if key_cache.dtype != query.dtype:
        raise ValueError(f"{what}: query {query.dtype} and caches {key_cache.dtype} differ (tl.dot takes one "
                         "dtype); cast the query to the caches' dtype")
    if query.stride(2) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if query.dtype == torch.float32:
        dot = _DOT_IEEE
    elif query.dtype == torch.bfloat16 and _INTERPRETED:
        dot = _DOT_UPCAST
    else:
        dot = _DOT_NATIVE
    grid = (num_seqs, -(-max_query_len // (block_m // group)), num_kv_heads)
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        out,
        float(scale) * 1.4426950408889634,  # log2(e): the kernel's softmax uses exp2
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        HEADS_PER_KV=heads_per_kv, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_N=block_n, DOT=dot,
        num_warps=4, num_stages=2,
    )
    return out


def _check_shapes(what: str, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, out: torch.Tensor | None) -> None:
    """Checks that cost nothing on the device: shapes, dtypes, devices, layouts."""
    if query.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(f"{what}: query {tuple(query.shape)} and key cache {tuple(key_cache.shape)}; pass the "
                         "query as [tokens, num_heads, head_dim] and the caches as "
                         "[num_kv_heads, num_blocks, block_size, head_dim]")
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
        raise ValueError(f"{what}: the caches' head_dim must be contiguous (stride 1); pass contiguous caches")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"{what}: key cache {key_cache.dtype} and value cache {value_cache.dtype} differ; "
                         "allocate both in one dtype")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{what}: dtype {query.dtype} is not supported; use float32, float16 or bfloat16")
    devices = {t.device for t in (query, key_cache, value_cache, block_tables)}
    if len(devices) != 1:
        raise ValueError(f"{what}: query, caches and block_tables are on {sorted(map(str, devices))}; "
                         "put them on one device")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: block_tables {tuple(block_tables.shape)} {block_tables.dtype}; pass "
                         "[num_seqs, max_blocks] int32 or int64")
    if block_tables.stride(1) != 1:
        raise ValueError(f"{what}: block_tables' rows must be contiguous (stride 1 along the blocks)")
    if out is not None and (out.shape != query.shape or out.device != query.device or out.stride(2) != 1):
        raise ValueError(f"{what}: out {tuple(out.shape)} on {out.device} (head_dim stride {out.stride(2)}); it "
                         f"must have the query's shape {tuple(query.shape)} and device, head_dim contiguous")


def _check_index_tensor(what: str, name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.dtype not in (torch.int32, torch.int64) or tensor.device != device:
        raise ValueError(f"{what}: {name} is {tensor.dtype} on {tensor.device}; pass int32 on the query's "
                         f"device ({device}), built once per step by the runner")
    if tensor.dim() == 1 and tensor.numel() > 1 and tensor.stride(0) != 1:
        raise ValueError(f"{what}: {name} must be contiguous")


__all__ = ["choose_blocks_per_split", "decode_tile_tokens", "paged_decode_attention", "paged_prefill_attention"]
