"""A whole decode step of a Llama-shaped decoder (with Qwen2's q/k/v biases, Qwen3's q/k head norms) as one C call:
the small-batch CPU path.

Why: at one to a few sequences a decode step reads each weight once and does little else, so it should
cost about its weights' read. Run as torch ops it costs far more: a decoder layer is ten calls (norm,
QKV, rotary, KV store, attention, O, norm, gate-up, SiLU-and-mul, down), each with Python, dispatch and
an OpenMP fork/join, and at one row the oneDNN matmuls are themselves mostly call overhead
(bench/RESULTS.md, issue 36). Here the embedding lookup, every layer and the final norm run inside one
OpenMP parallel region: the matrix-vector products split their output rows among the threads (dynamic
chunks, so a slowed thread takes fewer), attention splits by sequence and KV head (each key and value
read once for the query heads that share it), the norms run on every thread (each into its own copy),
so a layer has five barriers: after QKV, attention, O, gate-up and down.

What it computes is `decode_step_reference` below (the model's own modules, which is what the model's
forward runs), rounding where that rounds: every op's output in the model's dtype (bfloat16 after each
matmul, norm, rotary product and sum, SiLU and product, as torch's ops and the fused kernels of
ops/cpu_fused.py round), statistics and sums in float32. What differs is the order of the sums: the
matmuls' dot products (here AVX-512 BF16 `vdpbf16ps`: exact products, float32 sums, the same arithmetic
as oneDNN's bfloat16 matmul in another order) and attention's softmax (an exact float32 softmax). The tests
compare the two (tests/ops/test_cpu_decode_step.py).

Built and loaded as ops/cpu_build.py says (the system C compiler, ~/.cache/asyncengine/kernels, ctypes,
the OpenMP runtime torch has loaded); `ASYNCENGINE_CPU_KERNELS=0` turns it off. The engine's use of it:
asyncengine/worker/cpu_decode.py.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from asyncengine.ops.cpu_decode_blocks import BLOCKS_C, BlockWeights, block_weight_tables
from asyncengine.ops.cpu_build import AVX512_BF16, AVX512_EXP, C_PRELUDE, KernelLibrary

C_SOURCE = C_PRELUDE + AVX512_EXP + r"""
#include <stdlib.h>
#include <omp.h>
#include <sched.h>
#if defined(__AVX512F__)
#include <immintrin.h>
""" + AVX512_BF16 + r"""#endif

typedef struct {
    const void *norm1, *qkv, *o, *norm2, *gate_up, *down;  /* weights, [out, in] row-major */
    void *k_cache, *v_cache;                                 /* [kv_heads, num_blocks, block_size, head_dim] */
    const void *qkv_bias;                                    /* [qkv rows] or NULL (Qwen2) */
    const void *q_norm, *k_norm;                             /* [head_dim] RMSNorm weights or NULL (Qwen3) */
    const void *blocks;  /* NULL, or blocks_t[4]: qkv, o, gate_up, down as GGUF blocks (then those four are NULL) */
} layer_t;

/* sums[b] = dot(x[b, :K], w[:K]) in float32, for the B (<= MAX_ROWS) rows of x. The weights stream through
   once, so each load is preceded by a prefetch PREFETCH_BYTES further on (into the next rows, which the same
   thread mostly reads next): at one row the step is this loop, and the hardware prefetcher alone left it
   15-20% slower (one thread, a 212 MB bfloat16 matrix). A prefetch past the end is harmless. */
#define MAX_ROWS 8
#define PREFETCH_BYTES 4096
static void dot_rows(const void *x, const void *w, int64_t K, int64_t B, int is_bf16, float *sums) {
    int64_t k0 = 0;
    for (int64_t b = 0; b < B; b++) sums[b] = 0.0f;
#if defined(__AVX512BF16__)
    if (is_bf16 && B == 1) {  /* one row: four accumulators in registers, four chains in flight */
        const uint16_t *wr = (const uint16_t *)w, *xr = (const uint16_t *)x;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        for (; k0 + 128 <= K; k0 += 128) {
            const char *ahead = (const char *)(wr + k0) + PREFETCH_BYTES;
            _mm_prefetch(ahead, _MM_HINT_T0); _mm_prefetch(ahead + 64, _MM_HINT_T0);
            _mm_prefetch(ahead + 128, _MM_HINT_T0); _mm_prefetch(ahead + 192, _MM_HINT_T0);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(xr + k0)),
                                  (__m512bh)_mm512_loadu_si512((const void *)(wr + k0)));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void *)(xr + k0 + 32)),
                                  (__m512bh)_mm512_loadu_si512((const void *)(wr + k0 + 32)));
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512((const void *)(xr + k0 + 64)),
                                  (__m512bh)_mm512_loadu_si512((const void *)(wr + k0 + 64)));
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512((const void *)(xr + k0 + 96)),
                                  (__m512bh)_mm512_loadu_si512((const void *)(wr + k0 + 96)));
        }
        for (; k0 + 32 <= K; k0 += 32) {
            _mm_prefetch((const char *)(wr + k0) + PREFETCH_BYTES, _MM_HINT_T0);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(xr + k0)),
                                  (__m512bh)_mm512_loadu_si512((const void *)(wr + k0)));
        }
        sums[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    } else if (is_bf16) {
        __m512 acc[MAX_ROWS], acc2[MAX_ROWS];
        for (int64_t b = 0; b < B; b++) { acc[b] = _mm512_setzero_ps(); acc2[b] = _mm512_setzero_ps(); }
        const uint16_t *wr = (const uint16_t *)w;
        for (; k0 + 64 <= K; k0 += 64) {
            _mm_prefetch((const char *)(wr + k0) + PREFETCH_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)(wr + k0) + PREFETCH_BYTES + 64, _MM_HINT_T0);
            const __m512i w0 = _mm512_loadu_si512((const void *)(wr + k0));
            const __m512i w1 = _mm512_loadu_si512((const void *)(wr + k0 + 32));
            for (int64_t b = 0; b < B; b++) {
                const uint16_t *xr = (const uint16_t *)x + b * K + k0;
                acc[b] = _mm512_dpbf16_ps(acc[b], (__m512bh)_mm512_loadu_si512((const void *)xr), (__m512bh)w0);
                acc2[b] = _mm512_dpbf16_ps(acc2[b], (__m512bh)_mm512_loadu_si512((const void *)(xr + 32)),
                                           (__m512bh)w1);
            }
        }
        for (; k0 + 32 <= K; k0 += 32) {
            const __m512i w0 = _mm512_loadu_si512((const void *)(wr + k0));
            for (int64_t b = 0; b < B; b++)
                acc[b] = _mm512_dpbf16_ps(acc[b], (__m512bh)_mm512_loadu_si512((const void *)((const uint16_t *)x
                                                                                               + b * K + k0)),
                                          (__m512bh)w0);
        }
        for (int64_t b = 0; b < B; b++) sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(acc[b], acc2[b]));
    }
#endif
#if defined(__AVX512F__)
    if (!is_bf16) {
        __m512 acc[MAX_ROWS];
        for (int64_t b = 0; b < B; b++) acc[b] = _mm512_setzero_ps();
        const float *wr = (const float *)w;
        for (; k0 + 16 <= K; k0 += 16) {
            _mm_prefetch((const char *)(wr + k0) + PREFETCH_BYTES, _MM_HINT_T0);
            const __m512 w0 = _mm512_loadu_ps(wr + k0);
            for (int64_t b = 0; b < B; b++)
                acc[b] = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)x + b * K + k0), w0, acc[b]);
        }
        for (int64_t b = 0; b < B; b++) sums[b] = _mm512_reduce_add_ps(acc[b]);
    }
#endif
    for (int64_t b = 0; b < B; b++) {
        float s = 0.0f;
        for (int64_t k = k0; k < K; k++) s += load(x, b * K + k, is_bf16) * load(w, k, is_bf16);
        sums[b] += s;
    }
}

/* The team's barrier: spin briefly, then yield the core. libgomp's own barrier spins far longer before it
   sleeps, and on a shared machine a waiting thread that spins takes the core from the thread it waits for (or
   from the process that shares it): with two threads and other work on both cores the step took 10-50x its
   quiet time. Sense by generation: the last to arrive resets the count and starts the next generation. */
typedef struct { int count, generation; } barrier_t;
static void barrier_wait(barrier_t *bar, int threads) {
    if (threads == 1) return;
    const int generation = __atomic_load_n(&bar->generation, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&bar->count, 1, __ATOMIC_ACQ_REL) == threads) {
        __atomic_store_n(&bar->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&bar->generation, generation + 1, __ATOMIC_RELEASE);
        return;
    }
    for (int spins = 0; __atomic_load_n(&bar->generation, __ATOMIC_ACQUIRE) == generation; spins++) {
        if (spins < 4096) {
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
        } else {
            sched_yield();
        }
    }
}

/* out[b, n] = x[b] . w[n] (+ bias[n]) rounded to the dtype once, as the fused matmul-with-bias rounds, for this
   thread's share of the N rows. */
static void matvec(const void *x, const void *w, const void *bias, int64_t N, int64_t K, int64_t B, void *out,
                   int is_bf16, barrier_t *bar, int threads) {
    const int64_t es = is_bf16 ? 2 : 4;
    float sums[MAX_ROWS];
    #pragma omp for schedule(dynamic, 16) nowait
    for (int64_t n = 0; n < N; n++) {
        dot_rows(x, (const char *)w + n * K * es, K, B, is_bf16, sums);
        const float add = bias ? load(bias, n, is_bf16) : 0.0f;
        for (int64_t b = 0; b < B; b++) store(out, b * N + n, sums[b] + add, is_bf16);
    }
    barrier_wait(bar, threads);
}

""" + BLOCKS_C + r"""

/* out = x . w^T (+ bias) over the float weights w, or over block weights bw where the layer has them. */
static void weight_product(const void *x, const void *w, const blocks_t *bw, const void *bias, int64_t N,
                           int64_t K, int64_t B, void *out, int is_bf16, barrier_t *bar, int threads) {
    if (!bw) { matvec(x, w, bias, N, K, B, out, is_bf16, bar, threads); return; }
    block_matvec(x, bw, bias, N, K, B, out, is_bf16);
    barrier_wait(bar, threads);
}

/* RMSNorm with the residual addition (ops/cpu_fused.py's rms_norm, one row): s = x (+ residual, rounded),
   residual <- s, out = weight * norm(s) rounded as Llama's RMSNorm rounds. */
static void norm_row(const void *x, void *residual, int add, const void *weight, void *out, int64_t H, float eps,
                     int is_bf16, float *s) {
    float acc = 0.0f;
#if defined(__AVX512F__)
    if (is_bf16 && H % 16 == 0) {  /* the same roundings, 16 at a time (every thread runs each norm) */
        const uint16_t *xs = (const uint16_t *)x, *ws = (const uint16_t *)weight;
        uint16_t *rs = (uint16_t *)residual, *os = (uint16_t *)out;
        __m512 sq = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) {
            __m512 v = widen16(xs + i);
            if (add) v = round16(_mm512_add_ps(v, widen16(rs + i)));
            _mm512_storeu_ps(s + i, v);
            sq = _mm512_add_ps(sq, _mm512_mul_ps(v, v));
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)H + eps));
        for (int64_t i = 0; i < H; i += 16) {
            const __m512 v = _mm512_loadu_ps(s + i);
            _mm256_storeu_si256((__m256i *)(rs + i), narrow16(v));
            _mm256_storeu_si256((__m256i *)(os + i),
                                narrow16(_mm512_mul_ps(widen16(ws + i), round16(_mm512_mul_ps(v, inv)))));
        }
        return;
    }
#endif
    for (int64_t i = 0; i < H; i++) {
        float v = load(x, i, is_bf16);
        if (add) v = in_dtype(v + load(residual, i, is_bf16), is_bf16);
        s[i] = v;
    }
    for (int64_t i = 0; i < H; i++) acc += s[i] * s[i];
    const float inv = 1.0f / sqrtf(acc / (float)H + eps);
    for (int64_t i = 0; i < H; i++) {
        store(residual, i, s[i], is_bf16);
        if (is_bf16) store(out, i, load(weight, i, 1) * bf(to_bf(s[i] * inv)), 1);
        else store(out, i, load(weight, i, 0) * (s[i] * inv), 0);
    }
}

/* RMSNorm of one head (Qwen3's q_norm and k_norm), rounded as norm_row rounds, without a residual. */
static void norm_head(const void *x, const void *weight, void *out, int64_t D, float eps, int is_bf16) {
    float acc = 0.0f;
    for (int64_t i = 0; i < D; i++) { const float v = load(x, i, is_bf16); acc += v * v; }
    const float inv = 1.0f / sqrtf(acc / (float)D + eps);
    for (int64_t i = 0; i < D; i++) {
        const float v = load(x, i, is_bf16);
        if (is_bf16) store(out, i, load(weight, i, 1) * bf(to_bf(v * inv)), 1);
        else store(out, i, load(weight, i, 0) * (v * inv), 0);
    }
}

/* The NeoX rotation of one head (ops/cpu_fused.py's rotate): each product and the sum rounded. */
static void rotate_head(const void *src, void *dst, const void *cs, const void *sn, int64_t D, int is_bf16) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = load(src, i, is_bf16), b = load(src, i + half, is_bf16);
        const float lo = in_dtype(a * load(cs, i, is_bf16), is_bf16) + in_dtype(-b * load(sn, i, is_bf16), is_bf16);
        const float hi = in_dtype(b * load(cs, i + half, is_bf16), is_bf16) +
                         in_dtype(a * load(sn, i + half, is_bf16), is_bf16);
        store(dst, i, lo, is_bf16);
        store(dst, i + half, hi, is_bf16);
    }
}

/* out[b, j] = silu(g[b, j]) * u[b, j] for n (<= 16) gate and up values already rounded to the dtype: SiLU
   rounded, then the product rounded, as F.silu and torch's mul round (exp16: AVX-512, within an ulp of expf). */
static void silu_mul_block(const float *g, const float *u, int64_t n, void *out, int64_t j0, int is_bf16) {
    int64_t j = 0;
#if defined(__AVX512F__)
    if (n == 16) {
        const __m512 gv = _mm512_loadu_ps(g), uv = _mm512_loadu_ps(u);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        if (is_bf16) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + j0), narrow16(_mm512_mul_ps(round16(silu), uv)));
        } else {
            _mm512_storeu_ps((float *)out + j0, _mm512_mul_ps(silu, uv));
        }
        j = 16;
    }
#endif
    for (; j < n; j++)
        store(out, j0 + j, in_dtype(in_dtype(g[j] / (1.0f + expf(-g[j])), is_bf16) * u[j], is_bf16), is_bf16);
}

/* dot(q, row) over one head of D values (row in the dtype, q float32). */
static inline float dot_head(const float *q, const void *row, int64_t D, int is_bf16) {
    int64_t d = 0;
    float dot = 0.0f;
#if defined(__AVX512F__)
    __m512 sum = _mm512_setzero_ps();
    for (; d + 16 <= D; d += 16)
        sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d),
                              is_bf16 ? widen16((const uint16_t *)row + d) : _mm512_loadu_ps((const float *)row + d), sum);
    dot = _mm512_reduce_add_ps(sum);
#endif
    for (; d < D; d++) dot += q[d] * load(row, d, is_bf16);
    return dot;
}

#define MAX_GROUP 8  /* query heads attended together per pass over a KV head */

/* acc[g] += p[g] * row for G heads' accumulators of D values: the row is read (and widened) once. */
static inline void add_heads(float *acc, const float *p, int64_t G, const void *row, int64_t D, int is_bf16) {
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= D; d += 16) {
        const __m512 r = is_bf16 ? widen16((const uint16_t *)row + d) : _mm512_loadu_ps((const float *)row + d);
        for (int64_t g = 0; g < G; g++)
            _mm512_storeu_ps(acc + g * D + d, _mm512_fmadd_ps(_mm512_set1_ps(p[g]), r, _mm512_loadu_ps(acc + g * D + d)));
    }
#endif
    for (; d < D; d++) {
        const float r = load(row, d, is_bf16);
        for (int64_t g = 0; g < G; g++) acc[g * D + d] += p[g] * r;
    }
}

/* G (<= MAX_GROUP) query heads that share one KV head, over their sequence's context in the paged cache:
   each key and value row read once for all G; an exact softmax per head in float32. q: [G, D] in the dtype;
   scores: [G, ctx] scratch; out: [G, D] in the dtype. */
static void attend_group(const void *q, int64_t G, const void *k_cache, const void *v_cache, const int64_t *table,
                         int64_t ctx, int64_t kv_head, int64_t num_blocks, int64_t block_size, int64_t D, float scale,
                         int is_bf16, float *scores, void *out) {
    const int64_t es = is_bf16 ? 2 : 4, row_bytes = D * es;
    float qf[MAX_GROUP * 512], acc[MAX_GROUP * 512], top[MAX_GROUP], total[MAX_GROUP], p[MAX_GROUP];
    for (int64_t i = 0; i < G * D; i++) { qf[i] = load(q, i, is_bf16); acc[i] = 0.0f; }
    for (int64_t g = 0; g < G; g++) { top[g] = -INFINITY; total[g] = 0.0f; }
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {  /* block by block: no division per token */
        const char *kb = (const char *)k_cache + (kv_head * num_blocks + table[t0 / block_size]) * block_size * row_bytes;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int64_t i = 0; i < n; i++)
            for (int64_t g = 0; g < G; g++) {
                const float score = dot_head(qf + g * D, kb + i * row_bytes, D, is_bf16) * scale;
                scores[g * ctx + t0 + i] = score;
                if (score > top[g]) top[g] = score;
            }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * ctx;
        int64_t t = 0;
#if defined(__AVX512F__)
        __m512 sum = _mm512_setzero_ps();
        for (; t + 16 <= ctx; t += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), _mm512_set1_ps(top[g])));
            _mm512_storeu_ps(sg + t, e);
            sum = _mm512_add_ps(sum, e);
        }
        total[g] = _mm512_reduce_add_ps(sum);
#endif
        for (; t < ctx; t++) { sg[t] = expf(sg[t] - top[g]); total[g] += sg[t]; }
    }
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
        const char *vb = (const char *)v_cache + (kv_head * num_blocks + table[t0 / block_size]) * block_size * row_bytes;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int64_t i = 0; i < n; i++) {
            for (int64_t g = 0; g < G; g++) p[g] = scores[g * ctx + t0 + i];
            add_heads(acc, p, G, vb + i * row_bytes, D, is_bf16);
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) store(out, g * D + d, acc[g * D + d] / total[g], is_bf16);
}

/* Sequence b's KV head h: its new key (rotated) and value stored at the token's slot (none for a negative
   slot), then the group of query heads that reads that KV head, rotated and attended. */
static void attention_task(const layer_t *L, const char *qkv_row, const void *c, const void *sv, int64_t slot,
                           const int64_t *table, int64_t ctx, int64_t h, int64_t num_heads, int64_t num_kv_heads,
                           int64_t D, int64_t num_blocks, int64_t block_size, float scale, float eps,
                           int is_bf16, float *scores, char *attn_row) {
    const int64_t es = is_bf16 ? 2 : 4, Q = num_heads * D, group = num_heads / num_kv_heads;
    char normed[512 * 4];
    if (slot >= 0) {
        const int64_t at = ((h * num_blocks + slot / block_size) * block_size + slot % block_size) * D * es;
        const char *key = qkv_row + (Q + h * D) * es;
        if (L->k_norm) { norm_head(key, L->k_norm, normed, D, eps, is_bf16); key = normed; }
        rotate_head(key, (char *)L->k_cache + at, c, sv, D, is_bf16);
        memcpy((char *)L->v_cache + at, qkv_row + (Q + (num_kv_heads + h) * D) * es, D * es);
    }
    for (int64_t g0 = 0; g0 < group; g0 += MAX_GROUP) {
        const int64_t G = group - g0 < MAX_GROUP ? group - g0 : MAX_GROUP, first = h * group + g0;
        char *o = attn_row + first * D * es;
        if (ctx <= 0) { memset(o, 0, G * D * es); continue; }
        char qrot[MAX_GROUP * 512 * 4];
        for (int64_t g = 0; g < G; g++) {
            const char *query = qkv_row + (first + g) * D * es;
            if (L->q_norm) { norm_head(query, L->q_norm, normed, D, eps, is_bf16); query = normed; }
            rotate_head(query, qrot + g * D * es, c, sv, D, is_bf16);
        }
        attend_group(qrot, G, L->k_cache, L->v_cache, table, ctx, h, num_blocks, block_size, D, scale, is_bf16,
                     scores + first * ctx, o);
    }
}

/* The decode step of B sequences (one new token each) through every layer, ending with the final norm:
   out [B, H] in the dtype. ids, slots: [B] int64 (a negative slot stores nothing: a padding row);
   cs, sn: [B, D] the rotary cos/sin of each token's position, in the dtype; tables: [B, table_stride] int64;
   seq_lens [B] int32 (the context after this token; 0: a padding row, which attends to nothing).
   With lm_head ([V, H], or NULL): also logits [B, V] = out . lm_head^T in the dtype (the LM head, whose V
   rows are a fifth of a small model's weights: a matrix-vector product, which oneDNN's one-row matmul streams
   2-3x slower than this loop).
   Returns 0, -1 for a shape it does not take (B > MAX_ROWS, D > 512), -2 when scratch memory is short.

   Five barriers a layer (barrier_wait: libgomp's work-sharing loops run with nowait), one after each phase
   whose output every thread reads: QKV, attention, O, gate-up and down. The norms need none: every thread computes them itself, into its own input row and its own copy
   of the residual stream (the same arithmetic, so the same values), straight after the barrier that made
   the hidden state whole. Attention runs one task per (sequence, KV head), which stores that head's new key
   and value before reading it: no barrier between the store and the reads. */
int decode_step(const layer_t *layers, int64_t num_layers, const void *embed, const void *final_norm,
                const int64_t *ids, const void *cs, const void *sn, const int64_t *slots, const int64_t *tables,
                int64_t table_stride, const int32_t *seq_lens, int64_t B, int64_t H, int64_t num_heads,
                int64_t num_kv_heads, int64_t D, int64_t I, int64_t num_blocks, int64_t block_size, float eps,
                float scale, int is_bf16, void *out, const void *lm_head, int64_t V, void *logits, int threads) {
    if (B < 1 || B > MAX_ROWS || D > 512 || D % 2 || threads < 1) return -1;
    const int64_t es = is_bf16 ? 2 : 4, Q = num_heads * D, QKV = (num_heads + 2 * num_kv_heads) * D;
    int64_t max_ctx = 1;
    for (int64_t b = 0; b < B; b++) if (seq_lens[b] > max_ctx) max_ctx = seq_lens[b];
    char *mem = malloc((size_t)es * B * (H + QKV + Q + I));
    char *own = malloc((size_t)threads * B * H * 2 * es);  /* each thread's input rows and residual stream */
    float *scores_all = malloc(sizeof(float) * (size_t)max_ctx * B * num_heads);
    if (!mem || !own || !scores_all) { free(mem); free(own); free(scores_all); return -2; }
    char *hidden = mem, *qkv = hidden + es * B * H, *attn = qkv + es * B * QKV, *act = attn + es * B * Q;
    for (int64_t b = 0; b < B; b++) memcpy(hidden + b * H * es, (const char *)embed + ids[b] * H * es, H * es);
    barrier_t bar = {0, 0};
    #pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), team = omp_get_num_threads();
        char *x = own + (size_t)tid * B * H * 2 * es, *residual = x + B * H * es;
        float s[8192];
        for (int64_t l = 0; l < num_layers; l++) {
            const layer_t *L = layers + l;
            for (int64_t b = 0; b < B; b++)
                norm_row(hidden + b * H * es, residual + b * H * es, l > 0, L->norm1, x + b * H * es, H, eps,
                         is_bf16, s);
            weight_product(x, L->qkv, LAYER_BLOCKS(L, 0), L->qkv_bias, QKV, H, B, qkv, is_bf16, &bar, team);
            #pragma omp for schedule(dynamic, 1) nowait
            for (int64_t task = 0; task < B * num_kv_heads; task++) {
                const int64_t b = task / num_kv_heads;
                attention_task(L, qkv + b * QKV * es, (const char *)cs + b * D * es, (const char *)sn + b * D * es,
                               slots[b], tables + b * table_stride, seq_lens[b], task % num_kv_heads, num_heads,
                               num_kv_heads, D, num_blocks, block_size, scale, eps, is_bf16,
                               scores_all + b * num_heads * max_ctx, attn + b * Q * es);
            }
            barrier_wait(&bar, team);
            weight_product(attn, L->o, LAYER_BLOCKS(L, 1), NULL, H, Q, B, hidden, is_bf16, &bar, team);
            for (int64_t b = 0; b < B; b++)
                norm_row(hidden + b * H * es, residual + b * H * es, 1, L->norm2, x + b * H * es, H, eps,
                         is_bf16, s);
            if (L->blocks) block_gate_up(x, LAYER_BLOCKS(L, 2), I, H, B, act, is_bf16);
            else {   /* gate and up rows j and I + j together, 16 j at a time: their SiLU-and-product at once */
                float g[MAX_ROWS][16], u[MAX_ROWS][16], sums[MAX_ROWS];
                #pragma omp for schedule(dynamic, 1) nowait
                for (int64_t j0 = 0; j0 < I; j0 += 16) {
                    const int64_t n = I - j0 < 16 ? I - j0 : 16;
                    for (int64_t j = 0; j < n; j++) {
                        dot_rows(x, (const char *)L->gate_up + (j0 + j) * H * es, H, B, is_bf16, sums);
                        for (int64_t b = 0; b < B; b++) g[b][j] = in_dtype(sums[b], is_bf16);
                        dot_rows(x, (const char *)L->gate_up + (I + j0 + j) * H * es, H, B, is_bf16, sums);
                        for (int64_t b = 0; b < B; b++) u[b][j] = in_dtype(sums[b], is_bf16);
                    }
                    for (int64_t b = 0; b < B; b++) silu_mul_block(g[b], u[b], n, act + b * I * es, j0, is_bf16);
                }
            }
            barrier_wait(&bar, team);
            weight_product(act, L->down, LAYER_BLOCKS(L, 3), NULL, H, I, B, hidden, is_bf16, &bar, team);
        }
        for (int64_t b = 0; b < B; b++)
            norm_row(hidden + b * H * es, residual + b * H * es, num_layers > 0, final_norm, x + b * H * es, H,
                     eps, is_bf16, s);
        if (tid == 0) memcpy(out, x, B * H * es);
        if (lm_head) matvec(x, lm_head, NULL, V, H, B, logits, is_bf16, &bar, team);
    }
    free(mem);
    free(own);
    free(scores_all);
    return 0;
}
"""

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
MAX_ROWS = 8  # the kernel's largest batch (MAX_ROWS in the C source)
MAX_HIDDEN = 8192  # its norms' per-row scratch
MAX_HEAD_DIM = 512
# -ffp-contract=off: the elementwise steps round where torch's separate ops do (the dot products use
# explicit fused multiply-adds, as any matmul does).
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"],
              ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"])


class Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("norm1", "qkv", "o", "norm2", "gate_up", "down", "k_cache", "v_cache", "qkv_bias", "q_norm",
                 "k_norm", "blocks")]


_P, _I = ctypes.c_void_p, ctypes.c_int64


def _declare(library: ctypes.CDLL) -> None:
    library.has_blocks.restype = ctypes.c_int
    library.has_blocks.argtypes = []
    library.decode_step.restype = ctypes.c_int
    argtypes: list[Any] = [_P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _P] + [_I] * 8 + \
        [ctypes.c_float, ctypes.c_float, ctypes.c_int, _P, _P, _I, _P, ctypes.c_int]
    library.decode_step.argtypes = argtypes


_kernels = KernelLibrary("cpu_decode_step", C_SOURCE, _FLAG_SETS, _declare, dtypes=SUPPORTED_DTYPES,
                         what="CPU decode-step kernel", fallback="decode steps run the model's layers one op at a time")


def available(dtype: torch.dtype) -> bool:
    """Whether the compiled kernel runs for a model in `dtype` (compiling it on first use)."""
    return _kernels.available(dtype)


def unavailable_reason() -> str | None:
    return _kernels.unavailable_reason()


def blocks_available(dtype: torch.dtype) -> bool:
    """Whether the compiled kernel also takes GGUF block weights (AVX-512 VNNI, the compiler's -march=native)."""
    return _kernels.available(dtype) and _kernels.get(dtype).has_blocks() == 1


class DecoderWeights:
    """The tensors one decode step reads, as the kernel takes them: per layer (norm1, qkv, o, norm2, gate_up,
    down, key cache, value cache) and optionally (qkv bias, q norm, k norm), each None where the model has none
    (Qwen2 has the bias, Qwen3 the head norms, which use `eps` too); and the embedding and final norm. With
    `blocks`, a layer's entry there (ops/cpu_block_int8.py's PackedBlocks, or PackedNibbles, of qkv, o, gate_up
    and down: a GGUF file's blocks) replaces its four float weights, which are None. The caller keeps every tensor alive."""

    def __init__(self, layers: Sequence[Sequence[torch.Tensor | None]], embed: torch.Tensor, final_norm: torch.Tensor,
                 *, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float,
                 lm_head: torch.Tensor | None = None,
                 blocks: Sequence[Sequence[BlockWeights] | None] | None = None) -> None:
        self.tensors = [tuple(layer) + (None,) * (len(Layer._fields_) - 1 - len(layer)) for layer in layers]
        self.embed, self.final_norm, self.lm_head = embed, final_norm, lm_head
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.scale = eps, scale
        self.hidden_size = embed.shape[1]
        self.blocks = block_weight_tables(blocks, len(self.tensors), self.hidden_size, num_heads * head_dim,
                                    (num_heads + 2 * num_kv_heads) * head_dim)
        for index, layer in enumerate(self.tensors):
            if (self.blocks is None or self.blocks[index] is None) and any(t is None for t in layer[1:3] + layer[4:6]):
                raise ValueError(f"decode_step: layer {index} has neither float weights nor block weights")
        first_gate_up = self.tensors[0][4] if self.tensors else None
        self.intermediate_size = first_gate_up.shape[0] // 2 if first_gate_up is not None else \
            self.blocks[0][1][2].n // 2 if self.blocks and self.blocks[0] else 0
        self.dtype = embed.dtype
        tensors = [embed, final_norm] + [t for layer in self.tensors for t in layer if t is not None] + \
            ([] if lm_head is None else [lm_head])
        if not all(t.is_contiguous() and t.device.type == "cpu" and t.dtype == self.dtype for t in tensors):
            raise ValueError("decode_step takes contiguous CPU tensors, all in the model's dtype")
        if lm_head is not None and (lm_head.dim() != 2 or lm_head.shape[1] != self.hidden_size):
            raise ValueError(f"decode_step's LM head is [vocab, {self.hidden_size}], got {list(lm_head.shape)}")
        if self.hidden_size > MAX_HIDDEN or head_dim > MAX_HEAD_DIM or head_dim % 2 or num_heads % num_kv_heads:
            raise ValueError(f"decode_step takes hidden sizes up to {MAX_HIDDEN}, even head sizes up to "
                             f"{MAX_HEAD_DIM} and whole GQA groups")
        self.table = (Layer * len(self.tensors))(*[
            Layer(*[None if t is None else t.data_ptr() for t in layer],
                  None if block_table is None else ctypes.addressof(block_table[0]))
            for layer, block_table in zip(self.tensors, self.blocks or [None] * len(self.tensors))])


def decode_step(weights: DecoderWeights, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slots: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the final hidden states `[B, hidden]` (after the model's last norm), their LM head's output `[B, vocab]` in
    the model's dtype or None when `weights` has no LM head) of B decoding tokens: `input_ids`,
    `slots` `[B]` int64, `cos`/`sin` `[B, head_dim]` in the model's dtype (the rotary tables at each token's
    position), `block_tables` `[B, width]` int64, `seq_lens` `[B]` int32 (each context with this token).
    Each token's key and value are stored at its slot of each layer's cache (none for a negative slot)."""
    library = _kernels.get(weights.dtype)
    rows = input_ids.numel()
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"decode_step takes 1 to {MAX_ROWS} sequences, got {rows}")
    if out is None:
        out = torch.empty(rows, weights.hidden_size, dtype=weights.dtype)
    head = weights.lm_head
    logits = None if head is None else torch.empty(rows, head.shape[0], dtype=weights.dtype)
    k_cache = weights.tensors[0][6] if weights.tensors else weights.embed.new_empty(1, 1, 1, 1)
    _, num_blocks, block_size, _ = k_cache.shape
    int64 = (input_ids, slots, block_tables)
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in int64) or seq_lens.dtype != torch.int32 \
            or not seq_lens.is_contiguous() or cos.dtype != weights.dtype or sin.dtype != weights.dtype \
            or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("decode_step: ids, slots and block tables contiguous int64, seq_lens int32, cos/sin "
                         "contiguous in the model's dtype")
    status = library.decode_step(
        ctypes.addressof(weights.table), len(weights.tensors), weights.embed.data_ptr(), weights.final_norm.data_ptr(),
        input_ids.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], seq_lens.data_ptr(), rows, weights.hidden_size, weights.num_heads,
        weights.num_kv_heads, weights.head_dim, weights.intermediate_size, num_blocks, block_size, weights.eps,
        weights.scale, int(weights.dtype == torch.bfloat16), out.data_ptr(), None if head is None else head.data_ptr(),
        0 if head is None else head.shape[0], None if logits is None else logits.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise MemoryError("decode_step could not allocate its scratch memory")
    if status != 0:
        raise ValueError(f"decode_step refused the shapes (status {status})")
    return out, logits
