"""The mixture-of-experts op as a grouped GEMM in Triton, for CUDA; the torch reference is ops/fused_moe.py's.

`fused_moe_triton(hidden, router_logits, w13, w2, w13_bias, w2_bias, config)` is the "triton" provider of op
"fused_moe". It computes what `fused_moe_reference` does, with the same routing (`select_experts`):

1. `align_to_blocks`: the M*k (token, slot) pairs sorted by expert, each expert's run padded to a multiple of
   BLOCK_M (padding slots hold the sentinel M*k), and each block of BLOCK_M slots labelled with its expert
   (-1 for blocks past the last expert's run). All on the device, with no host synchronisation: the number of
   blocks is the bound M*k / BLOCK_M + min(E, M*k) (each expert pads less than one block), and surplus blocks
   return at once. (vLLM's moe_align_block_size is the same idea.)
2. `_expert_gemm_kernel` for gate-up: a program per (block, BLOCK_N columns) multiplies its BLOCK_M token rows
   (gathered through the pairs: row = pair // k) by its one expert's `w13` and writes rows indexed by pair;
3. the activation (SiLU-and-multiply, or GPT-OSS's clamped swiglu) per pair;
4. `_expert_gemm_kernel` for down, on the pairs' rows, each result rounded to the model dtype (as the reference
   rounds each expert's output), times the pair's router weight, in float32; pairs of experts not held here
   stay zero;
5. each token's k rows summed in float32 and rounded once.

Products run on `tl.dot` (float32 with "ieee" products, not TF32, to match the float32 reference; bfloat16
under the interpreter upcast first, as ops/triton_attention.py explains). The block sizes are not tuned on a
GPU yet (none was available when it was written): BLOCK_M 16 for decode-sized batches, else 64.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from asyncengine.ops.fused_moe import MoeConfig, check_arguments, select_experts
from asyncengine.ops.triton_attention import _DOT_IEEE, _DOT_NATIVE, _DOT_UPCAST, _dot

BLOCK_N = 64
BLOCK_K = 32
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def align_to_blocks(local_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(`pairs` int64 `[blocks * block_m]`, `block_expert` int64 `[blocks]`) for the flat local expert id of
    each (token, slot) pair (`num_experts` for a pair whose expert is not held here)."""
    pairs_total, device = local_ids.numel(), local_ids.device
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, local_ids, torch.ones_like(local_ids))
    counts[num_experts] = 0  # pairs held elsewhere get no slots
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(local_ids, stable=True)
    expert_of = local_ids[order]
    blocks = -(-pairs_total // block_m) + min(num_experts, pairs_total)
    capacity = blocks * block_m
    # A pair's slot: its expert's padded start plus its rank among the expert's pairs; held-elsewhere pairs go
    # to one spare slot past the end, cut off below.
    slot = padded_start[expert_of] + torch.arange(pairs_total, device=device) - start[expert_of]
    slot = torch.where(expert_of < num_experts, slot, capacity)
    pairs = torch.full((capacity + 1,), pairs_total, dtype=torch.int64, device=device)
    pairs[slot] = order
    first_row = torch.arange(blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end[:num_experts], first_row, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return pairs[:capacity], block_expert


@triton.jit
def _to_dtype(x, dtype: tl.constexpr, BY_HAND: tl.constexpr):
    """float32 `x` in `dtype`, rounded to nearest-even. The interpreter truncates float32 -> bfloat16 (compiled
    Triton rounds): there (BY_HAND) the rounding is done on the bits first, so that the checks compare what
    a GPU computes."""
    if BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, bias_ptr, out_ptr, pairs_ptr, block_expert_ptr, weights_ptr,
    N, K, num_pairs, top_k,
    stride_a, stride_we, stride_wn, stride_wk, stride_bias, stride_out,
    ROWS_ARE_TOKENS: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
    ROUND_BY_HAND: tl.constexpr,
):
    """out[pair, n] = (a[row(pair)] . w[expert, n] (+ bias[expert, n])) (* weight[pair]) for one block of pairs
    of one expert and BLOCK_N columns n."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        expert = expert.to(tl.int64)
        pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        if ROWS_ARE_TOKENS:
            rows = pairs // top_k
        else:
            rows = pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + expert * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc += _dot(a, w, DOT)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if MUL_WEIGHT:
            # The expert's output rounded to the model dtype first, as the reference's F.linear returns it.
            acc = _to_dtype(acc, a_ptr.dtype.element_ty, ROUND_BY_HAND).to(tl.float32)
            acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
            result = acc  # the float32 output
        else:
            result = _to_dtype(acc, out_ptr.dtype.element_ty, ROUND_BY_HAND)
        tl.store(out_ptr + pairs[:, None] * stride_out + cols[None, :], result, mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _activation_kernel(x_ptr, out_ptr, pairs_ptr, num_pairs, inner, stride_x, stride_out, alpha, limit,
                       SWIGLUOAI: tl.constexpr, BLOCK: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """The row of one held pair: [gate | up] -> silu(gate) * up, or GPT-OSS's (clamp(up) + 1) * g * sigmoid(alpha g)
    with g = clamp(gate); each torch op's result rounded to the dtype as ops/fused_moe.py's `activate` rounds it.
    Padding slots (the sentinel pair) do nothing."""
    row = tl.load(pairs_ptr + tl.program_id(0))
    if row < num_pairs:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inner
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0)
        dtype = gate.dtype
        g = gate.to(tl.float32)
        if SWIGLUOAI:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(up.to(tl.float32), -limit), limit)
            u = _to_dtype(u + 1.0, dtype, ROUND_BY_HAND).to(tl.float32)
            scaled = _to_dtype(g * alpha, dtype, ROUND_BY_HAND).to(tl.float32)
            sig = _to_dtype(1.0 / (1.0 + tl.exp(-scaled)), dtype, ROUND_BY_HAND).to(tl.float32)
            out = u * _to_dtype(g * sig, dtype, ROUND_BY_HAND).to(tl.float32)
        else:
            silu = _to_dtype(g / (1.0 + tl.exp(-g)), dtype, ROUND_BY_HAND).to(tl.float32)
            out = silu * up.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, _to_dtype(out, dtype, ROUND_BY_HAND), mask=mask)


def _dot_mode(dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        return _DOT_IEEE
    return _DOT_UPCAST if _INTERPRETED and dtype == torch.bfloat16 else _DOT_NATIVE


def fused_moe_triton(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None, config: MoeConfig,
                     *, block_m: int | None = None) -> torch.Tensor:
    """`fused_moe_reference` as grouped GEMMs over token blocks sorted by expert (see the module's docstring)."""
    check_arguments(hidden, router_logits, w13, w2, w13_bias, w2_bias, config)
    tokens, size = hidden.shape
    experts, inner = w13.shape[0], w2.shape[2]
    if tokens == 0:
        return torch.empty((0, size), dtype=hidden.dtype, device=hidden.device)
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    weights, ids = select_experts(router_logits, config)
    k = ids.shape[1]
    pairs_total = tokens * k
    block_m = block_m or (16 if pairs_total <= 64 * experts else 64)
    local = (ids - config.first_expert).reshape(-1)
    local = torch.where((local >= 0) & (local < experts), local, experts)
    pairs, block_expert = align_to_blocks(local, experts, block_m)
    weights = weights.reshape(-1).contiguous()
    dot = _dot_mode(hidden.dtype)
    by_hand = _INTERPRETED and hidden.dtype == torch.bfloat16
    blocks = block_expert.numel()

    gate_up = torch.empty((pairs_total, 2 * inner), dtype=hidden.dtype, device=hidden.device)
    _expert_gemm_kernel[(blocks, triton.cdiv(2 * inner, BLOCK_N))](
        hidden, w13, w13_bias if w13_bias is not None else w13, gate_up, pairs, block_expert, weights,
        2 * inner, size, pairs_total, k,
        hidden.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
        w13_bias.stride(0) if w13_bias is not None else 0, gate_up.stride(0),
        ROWS_ARE_TOKENS=True, HAS_BIAS=w13_bias is not None, MUL_WEIGHT=False,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT=dot, ROUND_BY_HAND=by_hand)

    activated = torch.empty((pairs_total, inner), dtype=hidden.dtype, device=hidden.device)
    act_block = min(1024, triton.next_power_of_2(inner))
    _activation_kernel[(pairs.numel(), triton.cdiv(inner, act_block))](
        gate_up, activated, pairs, pairs_total, inner, gate_up.stride(0), activated.stride(0), config.swiglu_alpha,
        config.swiglu_limit, SWIGLUOAI=config.activation == "swigluoai", BLOCK=act_block, ROUND_BY_HAND=by_hand)

    weighted = torch.zeros((pairs_total, size), dtype=torch.float32, device=hidden.device)
    _expert_gemm_kernel[(blocks, triton.cdiv(size, BLOCK_N))](
        activated, w2, w2_bias if w2_bias is not None else w2, weighted, pairs, block_expert, weights,
        size, inner, pairs_total, k,
        activated.stride(0), w2.stride(0), w2.stride(1), w2.stride(2),
        w2_bias.stride(0) if w2_bias is not None else 0, weighted.stride(0),
        ROWS_ARE_TOKENS=False, HAS_BIAS=w2_bias is not None, MUL_WEIGHT=True,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT=dot, ROUND_BY_HAND=by_hand)
    return weighted.view(tokens, k, size).sum(dim=1).to(hidden.dtype)
