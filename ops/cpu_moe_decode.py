"""The MoE op for a few tokens (decode sizes) in one C call: grouping, both expert projections, the weighted sum.

At decode sizes the weights of the experts hit are all the op has to read, and the grouped path of
ops/cpu_moe.py spent more time around its C calls than in them (the Qwen3-30B-A3B shape at 1/4 scale, one
token: about 130 us of Python and torch ops per call, the counting sort, the gather, the combine, their
arguments, against about 80-140 us of expert GEMVs). Here, once the router's choice is made (`select_experts`,
the function every implementation shares, so that ties go as torch.topk sends them), one call of `moe_decode`:

1. counts each chosen expert for /metrics (when given the layer's counter), groups the (token, slot) pairs by
   held expert and gathers their rows of `hidden` (at most TOKENS tokens: one row tile of ops/cpu_moe.py's
   dot-product kernels, so each weight is read once);
2. one thread team, in two steps split over work units of BLOCK outputs, so that one or two experts still keep
   every thread busy: (expert, block of its intermediate rows): the gate and up rows' dot products, each value
   rounded to the dtype, and the activation; then, after the team's one barrier, (block of hidden columns):
   every expert's down rows for those columns, rounded to the dtype, and each token's sum over its slots times
   the router's weights in float32, rounded once, into the output.

The arithmetic is that of the grouped path (`moe_small_experts` then `moe_combine`), so the two agree to the
bit; the C source is built into ops/cpu_moe.py's library, whose dot-product kernels it uses.
"""

from __future__ import annotations

import ctypes

import torch

from asyncengine.ops.fused_moe import MoeConfig

# The most tokens the call takes (the dot products' row tile, RT in ops/cpu_moe.py's C source), and the most
# (token, slot) pairs (its scratch is on the stack).
TOKENS = 4
PAIRS = 64

C_SOURCE = r"""
#define DECODE_PAIRS 64
#define DECODE_BLOCK 32

/* The op for tokens <= RT in one call (ops/cpu_moe_decode.py): pair p = (token p / k, slot p % k) runs expert
   ids[p] - first with weight w[p] (a pair whose expert is not held here, outside [0, experts), adds nothing);
   x, w13, w2, the biases (or NULL) and out in the dtype. With counter not NULL, counter[ids[p]] += 1 for every p
   with 0 <= ids[p] < total. Returns 0; 2 where the call is larger than this kernel takes; -1 where scratch
   could not be allocated. */
int moe_decode(const void *x, int64_t tokens, int64_t H, int64_t I, int64_t experts, int64_t k, const int64_t *ids,
               int64_t first, const float *w, const void *w13, const void *w2, const void *b13, const void *b2,
               int activation, float alpha, float limit, void *out, int64_t *counter, int64_t total, int is_bf16,
               int threads) {
    const int64_t pairs = tokens * k, elem = is_bf16 ? 2 : 4;
    if (tokens > RT || pairs > DECODE_PAIRS) return 2;
    /* The held experts in order of first appearance (u), each one's pairs grouped after the previous ones' in
       pair order (so in token order): grouped row g of pair p is group[p]. */
    int64_t expert_of[DECODE_PAIRS], count[DECODE_PAIRS], begin[DECODE_PAIRS], unit_of[DECODE_PAIRS];
    int64_t group[DECODE_PAIRS], token_of[DECODE_PAIRS];
    int64_t used = 0;
    for (int64_t p = 0; p < pairs; p++) {
        if (counter && ids[p] >= 0 && ids[p] < total) counter[ids[p]]++;
        const int64_t e = ids[p] - first;
        unit_of[p] = -1;
        if (e < 0 || e >= experts) continue;
        int64_t u = 0;
        while (u < used && expert_of[u] != e) u++;
        if (u == used) { expert_of[used] = e; count[used++] = 0; }
        unit_of[p] = u;
        count[u]++;
    }
    int64_t held = 0;
    for (int64_t u = 0; u < used; u++) { begin[u] = held; held += count[u]; }
    if (held == 0) { memset(out, 0, tokens * H * elem); return 0; }
    int64_t next[DECODE_PAIRS];
    for (int64_t u = 0; u < used; u++) next[u] = begin[u];
    for (int64_t p = 0; p < pairs; p++) {
        group[p] = unit_of[p] < 0 ? -1 : next[unit_of[p]]++;
        if (group[p] >= 0) token_of[group[p]] = p / k;
    }
    char *xg = malloc(held * H * elem), *act = malloc(held * I * elem);
    if (!xg || !act) { free(xg); free(act); return -1; }
    for (int64_t g = 0; g < held; g++) memcpy(xg + g * H * elem, (const char *)x + token_of[g] * H * elem, H * elem);
    const int64_t inner_blocks = (I + DECODE_BLOCK - 1) / DECODE_BLOCK;
    const int64_t column_blocks = (H + DECODE_BLOCK - 1) / DECODE_BLOCK;
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        /* 1: per (expert, block of intermediate rows i0..): its gate rows i0.. and up rows I + i0.., the activation */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < used * inner_blocks; unit++) {
            const int64_t u = unit / inner_blocks, i0 = unit % inner_blocks * DECODE_BLOCK;
            const int64_t n = I - i0 < DECODE_BLOCK ? I - i0 : DECODE_BLOCK, e = expert_of[u];
            const char *xu = xg + begin[u] * H * elem, *we = (const char *)w13 + e * 2 * I * H * elem;
            const char *be = b13 ? (const char *)b13 + e * 2 * I * elem : NULL;
            float gu[DECODE_PAIRS * 2 * DECODE_BLOCK];  /* per row: the gate block, then the up block */
            expert_gemm(xu, 0, count[u], we + i0 * H * elem, be ? be + i0 * elem : NULL, n, H, gu, 2 * n, 1, is_bf16);
            expert_gemm(xu, 0, count[u], we + (I + i0) * H * elem, be ? be + (I + i0) * elem : NULL, n, H, gu + n,
                        2 * n, 1, is_bf16);
            expert_activation(gu, 0, count[u], n, activation, alpha, limit, act + (begin[u] * I + i0) * elem, I,
                              is_bf16);
        }
        /* 2: per block of hidden columns h0..: every expert's down rows h0.., then each token's weighted sum */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < column_blocks; unit++) {
            const int64_t h0 = unit * DECODE_BLOCK, n = H - h0 < DECODE_BLOCK ? H - h0 : DECODE_BLOCK;
            float y[DECODE_PAIRS * DECODE_BLOCK];  /* grouped row g's outputs h0.. at y[g * n] */
            for (int64_t u = 0; u < used; u++) {
                const int64_t e = expert_of[u];
                expert_gemm(act + begin[u] * I * elem, 0, count[u], (const char *)w2 + (e * H + h0) * I * elem,
                            b2 ? (const char *)b2 + (e * H + h0) * elem : NULL, n, I, y + begin[u] * n, n, 1, is_bf16);
            }
            for (int64_t m = 0; m < tokens; m++) {
                float acc[DECODE_BLOCK];
                for (int64_t c = 0; c < n; c++) acc[c] = 0.0f;
                for (int64_t j = 0; j < k; j++) {
                    const int64_t g = group[m * k + j];
                    if (g < 0) continue;
                    const float wt = w[m * k + j];
                    for (int64_t c = 0; c < n; c++) acc[c] += wt * y[g * n + c];
                }
                for (int64_t c = 0; c < n; c++) store(out, m * H + h0 + c, acc[c], is_bf16);
            }
        }
    }
    free(xg);
    free(act);
    return 0;
}
"""

_P, _I = ctypes.c_void_p, ctypes.c_int64


def declare(library: ctypes.CDLL) -> None:
    library.moe_decode.restype = ctypes.c_int
    library.moe_decode.argtypes = [_P, _I, _I, _I, _I, _I, _P, _I, _P, _P, _P, _P, _P, ctypes.c_int, ctypes.c_float,
                                   ctypes.c_float, _P, _P, _I, ctypes.c_int, ctypes.c_int]


def takes(tokens: int, top_k: int) -> bool:
    """Whether `run` takes a call of `tokens` tokens with this top-k."""
    return tokens <= TOKENS and tokens * top_k <= PAIRS


def run(library: ctypes.CDLL, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
        w2: torch.Tensor, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None, config: MoeConfig,
        expert_tokens: torch.Tensor | None) -> torch.Tensor:
    """`moe_decode` (`library`: ops/cpu_moe.py's, built for hidden's dtype) on `select_experts`' `weights` and
    `ids` for `hidden`, with contiguous weights and biases of hidden's dtype; each chosen expert counted into
    `expert_tokens` (contiguous int64 on CPU, indexed by the model's expert ids) when given."""
    tokens, width = hidden.shape
    hidden, ids, weights = hidden.contiguous(), ids.contiguous(), weights.contiguous()
    out = torch.empty((tokens, width), dtype=hidden.dtype)
    status = library.moe_decode(
        hidden.data_ptr(), tokens, width, w2.shape[2], w13.shape[0], ids.shape[1], ids.data_ptr(), config.first_expert,
        weights.data_ptr(), w13.data_ptr(), w2.data_ptr(), None if w13_bias is None else w13_bias.data_ptr(),
        None if w2_bias is None else w2_bias.data_ptr(), int(config.activation == "swigluoai"), config.swiglu_alpha,
        config.swiglu_limit, out.data_ptr(), None if expert_tokens is None else expert_tokens.data_ptr(),
        0 if expert_tokens is None else expert_tokens.numel(), int(hidden.dtype == torch.bfloat16),
        torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"moe_decode failed with status {status} (2: {tokens} tokens of top-{ids.shape[1]} is "
                           f"more than it takes, -1: out of memory)")
    return out
