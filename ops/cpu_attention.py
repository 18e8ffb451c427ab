"""Paged decode attention for CPU tensors, reading keys and values in place from their cache pages.

The torch reference (`paged_attention.py`, `_decode_attention`) gathers every decoding sequence's
blocks into a contiguous copy per layer and step (an `index_select` of the whole context) and then
multiplies: it moves the context three times. This kernel walks each sequence's block table and reads
each key and value once, where it lies: one task per (sequence, KV head), the query heads of that KV
head's group computed together (GQA without repeating K/V), an exact softmax over the context.

It is a small C file, compiled once per machine with the system C compiler (`cc`; ops/cpu_build.py) into
~/.cache/asyncengine/kernels and called through ctypes (which releases the GIL). It uses OpenMP:
the shared object names `libgomp.so.1`, which is the runtime torch has already loaded, so both share
one thread pool. Without a compiler, or when `ASYNCENGINE_CPU_KERNELS=0`, `available` says no and
the caller keeps the torch reference; `unavailable_reason` says why.

Float32 and bfloat16 caches (bfloat16 is widened to float32 for the arithmetic, as torch's CPU
matmuls do, and the result rounded to nearest-even). On a CPU with AVX-512 BF16 the bfloat16 query-key
dot products take the bfloat16 pairs as they are (vdpbf16ps: each product exact in float32, summed in
float32) and scale the sums, half the instructions of widening every key: prompt attention about 1.3x
faster in bfloat16 (bench/RESULTS.md, 2026-12-05); decode attention is bound by reading the cache. The
probability-value products there take two keys at a time the same way (the two value rows interleaved into
pairs, the probabilities rounded to bfloat16, as a bfloat16 matmul of P and V would): prompt attention about
1.45x faster again; the mean error against float64 grows from 1.4e-4 to 2.1e-4 (the largest stays the output's
own rounding).

On AVX-512 the kernel sums 16 keys' dot products at once by a tree of shuffles, prefetches each next
block, and takes the softmax's exponentials 16 at a time with its own polynomial (about 1 ulp; gcc calls
glibc's vector expf only under -ffast-math, and the scalar one was most of the kernel's arithmetic):
W3's per-layer decode shape (32 sequences, 12k tokens), one thread, about 2x faster than without them
in float32 and bfloat16 (bench/RESULTS.md).
"""

from __future__ import annotations

import ctypes

import torch

from asyncengine.ops.cpu_build import AVX512_EXP, KernelLibrary

C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t float_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#define LOAD_F32(p, i) ((const float *)(p))[i]
#define LOAD_BF16(p, i) bf16_to_float(((const uint16_t *)(p))[i])

/* A row's scores before its softmax: soft-capped (Gemma 2's `cap * tanh(s / cap)`, when softcap > 0), and the
   first `skip` (keys of the row's first block that lie before its sliding window) taken out. */
static inline void adjust_scores(float *s, int64_t L, int64_t skip, float softcap) {
    if (softcap > 0.0f)
        for (int64_t t = 0; t < L; t++) s[t] = softcap * tanhf(s[t] / softcap);
    for (int64_t t = 0; t < skip; t++) s[t] = -INFINITY;
}

/* One (sequence, KV head): G query heads over the sequence's L cached tokens. q: [G, D] float32, already
   scaled; scores: [G, L] scratch; acc: [G, D] gets the unnormalized output, inv[g] its normalizer.
   Always inlined with constant G and D where the dispatch below knows them, so the loops over D unroll
   into whole vectors and the accumulators stay in registers. */
#define DEFINE_TASK(NAME, LOAD, ELEM)                                                                \
static inline __attribute__((always_inline)) void NAME(                                              \
        const float *q, const void *kc, const void *vc, const int64_t *table, int64_t L, int64_t h,   \
        int64_t NB, int64_t BS, const int64_t G, const int64_t D, float *scores, float *acc, float *inv, \
        int64_t skip, float softcap, const float *sink) {                                            \
    for (int64_t b = 0, t0 = 0; t0 < L; b++, t0 += BS) {                                             \
        const int64_t count = L - t0 < BS ? L - t0 : BS;                                             \
        const ELEM *kblock = (const ELEM *)kc + ((h * NB + table[b]) * BS) * D;                      \
        for (int64_t o = 0; o < count; o++) {                                                        \
            const ELEM *krow = kblock + o * D;                                                       \
            for (int64_t g = 0; g < G; g++) {                                                        \
                const float *qg = q + g * D;                                                         \
                float dot = 0.0f;                                                                    \
                _Pragma("omp simd reduction(+:dot)")                                                 \
                for (int64_t d = 0; d < D; d++) dot += qg[d] * LOAD(krow, d);                         \
                scores[g * L + t0 + o] = dot;                                                        \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    for (int64_t g = 0; g < G; g++) {                                                                \
        float *s = scores + g * L, mx = sink ? sink[g] : -INFINITY, sum = 0.0f;                      \
        adjust_scores(s, L, skip, softcap);                                                          \
        for (int64_t t = 0; t < L; t++) mx = s[t] > mx ? s[t] : mx;                                  \
        _Pragma("omp simd")                                                                          \
        for (int64_t t = 0; t < L; t++) s[t] = expf(s[t] - mx);                                      \
        for (int64_t t = 0; t < L; t++) sum += s[t];                                                 \
        if (sink) sum += expf(sink[g] - mx);                                                         \
        inv[g] = 1.0f / sum;                                                                         \
    }                                                                                                \
    memset(acc, 0, sizeof(float) * G * D);                                                           \
    for (int64_t b = 0, t0 = 0; t0 < L; b++, t0 += BS) {                                             \
        const int64_t count = L - t0 < BS ? L - t0 : BS;                                             \
        const ELEM *vblock = (const ELEM *)vc + ((h * NB + table[b]) * BS) * D;                      \
        for (int64_t o = 0; o < count; o++) {                                                        \
            const ELEM *vrow = vblock + o * D;                                                       \
            for (int64_t g = 0; g < G; g++) {                                                        \
                const float p = scores[g * L + t0 + o];                                              \
                float *ag = acc + g * D;                                                             \
                _Pragma("omp simd")                                                                  \
                for (int64_t d = 0; d < D; d++) ag[d] += p * LOAD(vrow, d);                           \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
}

DEFINE_TASK(task_f32, LOAD_F32, float)
DEFINE_TASK(task_bf16, LOAD_BF16, uint16_t)

#if defined(__AVX512F__)
#include <immintrin.h>
""" + AVX512_EXP + r"""
/* The same task in AVX-512 for head_dim a multiple of 16: a key row is loaded once into C = D / 16
   vectors and multiplied by the G query heads kept in registers; the output accumulators stay in
   registers over the whole context. */
/* exp16 (x <= 0 here: a softmax's shifted scores): ops/cpu_build.py's AVX512_EXP, included above. */
/* The sums of 16 vectors, as one vector (lane j: the sum of v[j]), by a tree of shuffles: 46 operations
   where 16 horizontal reductions take about 130 (and a chain of dependent shuffles each). */
static inline __m512 sum16x16(const __m512 *v) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)  /* 256-bit halves: quarters 0-1 hold v[2i]'s partial sums, 2-3 v[2i+1]'s */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* quarter q: v[4i + q]'s four partial sums */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)  /* lane q: v[8i + q] in elements 0-1, v[8i + 4 + q] in 2-3 */
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    /* element 4q + k: the sum of v[q + 4k] */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, r);
}
/* s[0:L] <- exp(s - m), in place, m the largest of s and the sink logit; returns 1 / (the sum + exp(sink - m)).
   sink = -INFINITY: no sink. */
static inline float softmax_row_avx512(float *s, int64_t L, float sink) {
    __m512 mv = _mm512_set1_ps(sink);
    int64_t t = 0;
    for (; t + 16 <= L; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t));
    float mx = _mm512_reduce_max_ps(mv);
    for (int64_t u = t; u < L; u++) mx = s[u] > mx ? s[u] : mx;
    const __m512 mxv = _mm512_set1_ps(mx);
    __m512 sv = _mm512_setzero_ps();
    for (t = 0; t + 16 <= L; t += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), mxv));
        _mm512_storeu_ps(s + t, e);
        sv = _mm512_add_ps(sv, e);
    }
    if (t < L) {
        const __mmask16 m = (__mmask16)((1u << (L - t)) - 1u);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), mxv));
        _mm512_mask_storeu_ps(s + t, m, e);
        sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(m, e));
    }
    return 1.0f / (_mm512_reduce_add_ps(sv) + (sink == -INFINITY ? 0.0f : expf(sink - mx)));
}
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m256i half = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#define DEFINE_AVX512_TASK(NAME, LOADV, ELEM, DOT16, PV_PAIRS)                                       \
static inline __attribute__((always_inline)) void NAME(                                              \
        const float *q, const void *kc, const void *vc, const int64_t *table, int64_t L, int64_t h,   \
        int64_t NB, int64_t BS, const int64_t G, const int64_t D, float *scores, float *acc, float *inv, \
        int64_t skip, float softcap, const float *sink, const uint16_t *qraw, float scale) {         \
    const int64_t C = D / 16;                                                                        \
    __m512 qv[G * C], av[G * C];                                                                     \
    for (int64_t j = 0; j < G * C; j++) { qv[j] = _mm512_loadu_ps(q + j * 16); av[j] = _mm512_setzero_ps(); } \
    (void)qraw; (void)scale;                                                                         \
    for (int64_t b = 0, t0 = 0; t0 < L; b++, t0 += BS) {                                             \
        const int64_t count = L - t0 < BS ? L - t0 : BS;                                             \
        const ELEM *kblock = (const ELEM *)kc + ((h * NB + table[b]) * BS) * D;                      \
        const ELEM *knext = t0 + BS < L ? (const ELEM *)kc + ((h * NB + table[b + 1]) * BS) * D : kblock; \
        int64_t o = 0;                                                                               \
        for (; o + 16 <= count; o += 16) {  /* 16 keys at once, their dot products summed as a tree */   \
            for (int64_t j = 0; j < 16; j++)                                                         \
                for (int64_t c = 0; c < D * (int64_t)sizeof(ELEM); c += 64)                          \
                    __builtin_prefetch((const char *)(knext + (o + j) * D) + c, 0, 3);               \
            for (int64_t g = 0; g < G; g++) {                                                        \
                __m512 dots[16];                                                                     \
                _mm512_storeu_ps(scores + g * L + t0 + o, DOT16(g));                                 \
            }                                                                                        \
        }                                                                                            \
        for (; o < count; o++) {                                                                     \
            for (int64_t c = 0; c < D * (int64_t)sizeof(ELEM); c += 64)                              \
                __builtin_prefetch((const char *)(knext + o * D) + c, 0, 3);                         \
            __m512 kv[C];                                                                            \
            for (int64_t c = 0; c < C; c++) kv[c] = LOADV(kblock + o * D + c * 16);                   \
            for (int64_t g = 0; g < G; g++) {                                                        \
                __m512 dot = _mm512_mul_ps(qv[g * C], kv[0]);                                        \
                for (int64_t c = 1; c < C; c++) dot = _mm512_fmadd_ps(qv[g * C + c], kv[c], dot);   \
                scores[g * L + t0 + o] = _mm512_reduce_add_ps(dot);                                  \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    for (int64_t g = 0; g < G; g++) {                                                                \
        adjust_scores(scores + g * L, L, skip, softcap);                                             \
        inv[g] = softmax_row_avx512(scores + g * L, L, sink ? sink[g] : -INFINITY);                  \
    }                                                                                                \
    if (PV_PAIRS(vc, table, L, h, NB, BS, G, D, scores, acc)) return;                                \
    for (int64_t b = 0, t0 = 0; t0 < L; b++, t0 += BS) {                                             \
        const int64_t count = L - t0 < BS ? L - t0 : BS;                                             \
        const ELEM *vblock = (const ELEM *)vc + ((h * NB + table[b]) * BS) * D;                      \
        const ELEM *vnext = t0 + BS < L ? (const ELEM *)vc + ((h * NB + table[b + 1]) * BS) * D : vblock; \
        for (int64_t o = 0; o < count; o++) {                                                        \
            for (int64_t c = 0; c < D * (int64_t)sizeof(ELEM); c += 64)                              \
                __builtin_prefetch((const char *)(vnext + o * D) + c, 0, 3);                         \
            __m512 vv[C];                                                                            \
            for (int64_t c = 0; c < C; c++) vv[c] = LOADV(vblock + o * D + c * 16);                   \
            for (int64_t g = 0; g < G; g++) {                                                        \
                const __m512 p = _mm512_set1_ps(scores[g * L + t0 + o]);                             \
                for (int64_t c = 0; c < C; c++) av[g * C + c] = _mm512_fmadd_ps(p, vv[c], av[g * C + c]); \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    for (int64_t j = 0; j < G * C; j++) _mm512_storeu_ps(acc + j * 16, av[j]);                       \
}
/* The 16 scores of query head g against keys o..o+15 of kblock (inside DEFINE_AVX512_TASK): each key row
   widened to float32 and multiplied by the scaled float32 query, the 16 sums then added as a tree. */
#define DOT16_WIDEN(LOADV, ELEM)                                                                      \
    ({ for (int64_t j = 0; j < 16; j++) {                                                             \
           const ELEM *krow = kblock + (o + j) * D;                                                   \
           __m512 dot = _mm512_mul_ps(qv[g * C], LOADV(krow));                                        \
           for (int64_t c = 1; c < C; c++) dot = _mm512_fmadd_ps(qv[g * C + c], LOADV(krow + c * 16), dot); \
           dots[j] = dot;                                                                             \
       }                                                                                              \
       sum16x16(dots); })
#define DOT16_F32(g) DOT16_WIDEN(load16_f32, float)
#define DOT16_BF16(g) DOT16_WIDEN(load16_bf16, uint16_t)
#if defined(__AVX512BF16__)
/* bfloat16 with AVX-512 BF16: the unscaled bfloat16 query against the key rows as they lie, 32 elements
   per instruction (vdpbf16ps: products of bfloat16 pairs are exact in float32, summed in float32), the
   sums then scaled: half the instructions of widening every key. */
#define DOT16_DPBF16(g)                                                                               \
    ({ for (int64_t j = 0; j < 16; j++) {                                                             \
           const uint16_t *krow = kblock + (o + j) * D;                                               \
           __m512 dot = _mm512_setzero_ps();                                                          \
           for (int64_t c = 0; c < D; c += 32)                                                        \
               dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qraw + g * D + c),           \
                                      (__m512bh)_mm512_loadu_si512(krow + c));                        \
           dots[j] = dot;                                                                             \
       }                                                                                              \
       _mm512_mul_ps(sum16x16(dots), _mm512_set1_ps(scale)); })
#undef DOT16_BF16
#define DOT16_BF16(g) ((D % 32 == 0) ? DOT16_DPBF16(g) : DOT16_WIDEN(load16_bf16, uint16_t))
#endif
#define NO_PV_PAIRS(vc, table, L, h, NB, BS, G, D, scores, acc) 0
#if defined(__AVX512BF16__)
/* The probability-value products of a bfloat16 cache with AVX-512 BF16, two keys at a time: the two value
   rows interleaved into bfloat16 pairs (unpacklo/hi: a fixed order of the D lanes, undone at the end) and
   vdpbf16ps with the pair of probabilities rounded to bfloat16 (each product exact in float32, summed in
   float32), instead of widening every value row and a multiply-add per key: half the instructions. Writes
   acc ([G, D], unnormalized) and returns 1; returns 0 (nothing done) for a shape it does not take. */
static inline __attribute__((always_inline)) int pv_pairs_bf16(
        const void *vc, const int64_t *table, int64_t L, int64_t h, int64_t NB, int64_t BS, const int64_t G,
        const int64_t D, float *scores, float *acc) {
    static const uint16_t zeros[256] = {0};
    if (D % 32 || D > 256 || BS % 2) return 0;
    const int64_t C = D / 32;
    /* Each head's probabilities as bfloat16, in place at the start of its float row, and a 0 after the last
       (an odd context's missing partner): row g's 2 (L + 1) bytes fit in its 4 L. */
    for (int64_t g = 0; g < G; g++) {
        float *s = scores + g * L;
        uint16_t *pb = (uint16_t *)s;
        int64_t t = 0;
        for (; t + 32 <= L; t += 32)
            _mm512_storeu_si512(pb + t, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + t + 16), _mm512_loadu_ps(s + t)));
        for (; t < L; t++) pb[t] = float_to_bf16(s[t]);
        pb[L] = 0;
    }
    __m512 av[G * 2 * C];
    for (int64_t j = 0; j < G * 2 * C; j++) av[j] = _mm512_setzero_ps();
    for (int64_t b = 0, t0 = 0; t0 < L; b++, t0 += BS) {
        const int64_t count = L - t0 < BS ? L - t0 : BS;
        const uint16_t *vblock = (const uint16_t *)vc + ((h * NB + table[b]) * BS) * D;
        const uint16_t *vnext = t0 + BS < L ? (const uint16_t *)vc + ((h * NB + table[b + 1]) * BS) * D : vblock;
        for (int64_t o = 0; o < count; o += 2) {
            const uint16_t *v0 = vblock + o * D, *v1 = o + 1 < count ? v0 + D : zeros;
            for (int64_t c = 0; c < 2 * D * 2; c += 64) __builtin_prefetch((const char *)(vnext + o * D) + c, 0, 3);
            for (int64_t c = 0; c < C; c++) {
                const __m512i a = _mm512_loadu_si512(v0 + c * 32), n = _mm512_loadu_si512(v1 + c * 32);
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, n), hi = (__m512bh)_mm512_unpackhi_epi16(a, n);
                for (int64_t g = 0; g < G; g++) {
                    int32_t two;
                    memcpy(&two, (const uint16_t *)(scores + g * L) + t0 + o, 4);
                    const __m512bh p = (__m512bh)_mm512_set1_epi32(two);
                    av[(g * C + c) * 2] = _mm512_dpbf16_ps(av[(g * C + c) * 2], lo, p);
                    av[(g * C + c) * 2 + 1] = _mm512_dpbf16_ps(av[(g * C + c) * 2 + 1], hi, p);
                }
            }
        }
    }
    /* Lane 4j + i of the lo sums is d = 8j + i of its 32, of the hi sums d = 8j + 4 + i. */
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < C; c++) {
            float lo[16], hi[16];
            _mm512_storeu_ps(lo, av[(g * C + c) * 2]);
            _mm512_storeu_ps(hi, av[(g * C + c) * 2 + 1]);
            float *out = acc + g * D + c * 32;
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 4; i++) { out[8 * j + i] = lo[4 * j + i]; out[8 * j + 4 + i] = hi[4 * j + i]; }
        }
    return 1;
}
#define PV_PAIRS_BF16(vc, table, L, h, NB, BS, G, D, scores, acc) \
    pv_pairs_bf16(vc, table, L, h, NB, BS, G, D, scores, acc)
#else
#define PV_PAIRS_BF16 NO_PV_PAIRS
#endif
DEFINE_AVX512_TASK(task_f32_avx512, load16_f32, float, DOT16_F32, NO_PV_PAIRS)
DEFINE_AVX512_TASK(task_bf16_avx512, load16_bf16, uint16_t, DOT16_BF16, PV_PAIRS_BF16)
#define HAVE_AVX512_TASKS 1
#endif

/* Constant head_dim (64, 128, 256) and group size (1-8) for the common shapes, the generic loop otherwise.
   256 (Gemma 3) keeps more vectors than the registers hold, and still runs a decode batch 2.2x (float32) to
   3.2x (bfloat16) faster than the generic loop (32 sequences of 512 tokens, 4 query heads on one KV head). */
#ifdef HAVE_AVX512_TASKS
#define DISPATCH_D(TASK, GV)                                                                         \
    if (D == 64) TASK##_avx512(q, kc, vc, table, L, h, NB, BS, GV, 64, scores, acc, inv, skip, softcap, sink,  \
                               qraw, scale);                                                          \
    else if (D == 128) TASK##_avx512(q, kc, vc, table, L, h, NB, BS, GV, 128, scores, acc, inv, skip, softcap, \
                                     sink, qraw, scale);                                              \
    else if (D == 256) TASK##_avx512(q, kc, vc, table, L, h, NB, BS, GV, 256, scores, acc, inv, skip, softcap, \
                                     sink, qraw, scale);                                              \
    else TASK(q, kc, vc, table, L, h, NB, BS, GV, D, scores, acc, inv, skip, softcap, sink);
#else
#define DISPATCH_D(TASK, GV)                                                                         \
    if (D == 64) TASK(q, kc, vc, table, L, h, NB, BS, GV, 64, scores, acc, inv, skip, softcap, sink);   \
    else if (D == 128) TASK(q, kc, vc, table, L, h, NB, BS, GV, 128, scores, acc, inv, skip, softcap, sink); \
    else TASK(q, kc, vc, table, L, h, NB, BS, GV, D, scores, acc, inv, skip, softcap, sink);
#endif
#define DISPATCH(TASK)                                                                               \
    switch (G) {                                                                                     \
        case 1: { DISPATCH_D(TASK, 1) break; }                                                       \
        case 2: { DISPATCH_D(TASK, 2) break; }                                                       \
        case 3: { DISPATCH_D(TASK, 3) break; }                                                       \
        case 4: { DISPATCH_D(TASK, 4) break; }                                                       \
        case 8: { DISPATCH_D(TASK, 8) break; }                                                       \
        default: { DISPATCH_D(TASK, G) break; }                                                      \
    }

/* q, out: [tokens, H, D]; kc, vc: [KVH, NB, BS, D]; tables: [*, table_stride] int64;
   for decode i: its context length seq_lens[i] (int32), its row seqs[i] of tables and its query row rows[i].
   window > 0: each row sees only its last `window` keys (a sliding-window layer): the blocks before the one
   holding the window's first key are not read (their table entries may be stale or the null block), and the
   keys of that block before the window are masked. softcap > 0: scores soft-capped before the softmax.
   sinks (float32 [H], or NULL): each query head's sink logit joins its softmax and attends to nothing (GPT-OSS).
   Returns 0, or -1 when scratch memory could not be allocated. */
int paged_decode(const void *qv, const void *kc, const void *vc, const int64_t *tables, int64_t table_stride,
                 const int32_t *seq_lens, const int64_t *seqs, const int64_t *rows, void *outv, int64_t n,
                 int64_t H, int64_t KVH, int64_t NB, int64_t BS, int64_t D, float scale, int bf16, int64_t window,
                 float softcap, const float *sinks, int threads) {
    const int64_t G = H / KVH;
    int failed = 0;
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t context = seq_lens[i];
            const int64_t start = window > 0 && context > window ? context - window : 0;
            const int64_t first_block = start / BS, skip = start - first_block * BS;
            const int64_t L = context - first_block * BS;  /* keys from the window's first block on */
            const int64_t *table = tables + seqs[i] * table_stride + first_block;
            float *scratch = (float *)malloc(sizeof(float) * (G * L + 2 * G * D + G));
            if (scratch == NULL) { failed = 1; continue; }
            float *scores = scratch, *q = scratch + G * L, *acc = q + G * D, *inv = acc + G * D;
            const int64_t qbase = (rows[i] * H + h * G) * D;
            const uint16_t *qraw = bf16 ? (const uint16_t *)qv + qbase : NULL;  /* the group's heads, unscaled */
            const float *sink = sinks ? sinks + h * G : NULL;
            for (int64_t j = 0; j < G * D; j++)
                q[j] = scale * (bf16 ? LOAD_BF16(qv, qbase + j) : LOAD_F32(qv, qbase + j));
            if (L > 0) {
                if (bf16) { DISPATCH(task_bf16) } else { DISPATCH(task_f32) }
            } else {
                memset(acc, 0, sizeof(float) * G * D);
                for (int64_t g = 0; g < G; g++) inv[g] = 0.0f;
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t d = 0; d < D; d++) {
                    const float value = acc[g * D + d] * inv[g];
                    if (bf16) ((uint16_t *)outv)[qbase + g * D + d] = float_to_bf16(value);
                    else ((float *)outv)[qbase + g * D + d] = value;
                }
            free(scratch);
        }
    }
    return failed ? -1 : 0;
}

/* Each token's keys and values into its cache slot (block slot / BS, offset slot % BS), per KV head:
   key/value [tokens, KVH, D] with token and head strides (elements) and unit stride within a head; caches
   [KVH, NB, BS, D] contiguous; `elem` bytes per element. Returns 0, or -1 when a slot lies outside the
   cache (nothing is written then). */
int store_kv(const void *key, int64_t k_tok, int64_t k_head, const void *value, int64_t v_tok, int64_t v_head,
             void *kc, void *vc, const int64_t *slots, int64_t tokens, int64_t KVH, int64_t NB, int64_t BS,
             int64_t D, int64_t elem) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= NB * BS) return -1;
    const size_t row = (size_t)(D * elem);
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t at = (h * NB * BS + slots[t]) * D * elem;
            memcpy((char *)kc + at, (const char *)key + (t * k_tok + h * k_head) * elem, row);
            memcpy((char *)vc + at, (const char *)value + (t * v_tok + h * v_head) * elem, row);
        }
    }
    return 0;
}
"""

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# -fno-math-errno lets the exponentials of the softmax vectorize (glibc's vector expf).
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp", "-fno-math-errno"], ["-O3", "-fopenmp", "-fno-math-errno"])



def _declare(library: ctypes.CDLL) -> None:
    library.store_kv.restype = ctypes.c_int
    library.store_kv.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + \
        [ctypes.c_int64] * 6
    library.paged_decode.restype = ctypes.c_int
    library.paged_decode.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                                              ctypes.c_void_p, ctypes.c_void_p] + \
        [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                                ctypes.c_int]


_kernels = KernelLibrary("cpu_attention", C_SOURCE, _FLAG_SETS, _declare, dtypes=SUPPORTED_DTYPES,
                         what="CPU attention kernels",
                         fallback="attention uses the torch reference (prompts through scaled_dot_product_attention, "
                                  "decodes gathering the context each step)")


def available(dtype: torch.dtype) -> bool:
    """Whether the compiled kernels run for tensors of `dtype` (compiling them on first use)."""
    return _kernels.available(dtype)


def unavailable_reason() -> str | None:
    return _kernels.unavailable_reason()


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, seqs: torch.Tensor, rows: torch.Tensor, scale: float,
                 out: torch.Tensor, *, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 sinks: torch.Tensor | None = None) -> None:
    """Write into `out` `[tokens, heads, dim]` the attention of query row `rows[i]` over the first
    `seq_lens[i]` tokens of the blocks in row `seqs[i]` of `block_tables`, for every i; with `sliding_window`,
    over the last `sliding_window` of them only (the blocks before are not read), and with `logits_soft_cap`,
    the scores capped as `cap * tanh(score / cap)` before the softmax; with `sinks` `[heads]`, each query head's
    sink logit joins its softmax as one more term that attends to nothing (GPT-OSS), in float32.

    `query`, `out` `[tokens, heads, dim]` contiguous; caches `[kv_heads, num_blocks, block_size, dim]`
    contiguous; `block_tables` int64 with unit column stride, `seq_lens` int32, `seqs`/`rows` int64."""
    library = _kernels.get(query.dtype)
    num_kv_heads, num_blocks, block_size, head_dim = key_cache.shape
    tensors = (query, key_cache, value_cache, out, seq_lens, seqs, rows)
    if not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors) or block_tables.stride(1) != 1:
        raise ValueError("paged_decode needs contiguous CPU tensors (and block tables with unit column stride)")
    if not (query.dtype == key_cache.dtype == value_cache.dtype == out.dtype) or query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"paged_decode runs float32 or bfloat16 throughout, got query {query.dtype}, "
                         f"cache {key_cache.dtype}, out {out.dtype}")
    if seq_lens.dtype != torch.int32 or seqs.dtype != torch.int64 or rows.dtype != torch.int64 \
            or block_tables.dtype != torch.int64:
        raise ValueError("paged_decode: block_tables, seqs and rows are int64, seq_lens int32")
    if sinks is not None:
        if sinks.shape != (query.shape[1],) or sinks.device.type != "cpu":
            raise ValueError(f"paged_decode: sinks must be a CPU tensor of one logit per query head "
                             f"({query.shape[1]}), got {tuple(sinks.shape)} on {sinks.device}")
        sinks = sinks.detach().float().contiguous()
    status = library.paged_decode(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), seqs.data_ptr(), rows.data_ptr(), out.data_ptr(), seqs.numel(),
        query.shape[1], num_kv_heads, num_blocks, block_size, head_dim, scale, int(query.dtype == torch.bfloat16),
        int(sliding_window or 0), float(logits_soft_cap or 0.0), None if sinks is None else sinks.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("paged_decode could not allocate its scratch memory")


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """`paged_attention.store_kv` on CPU tensors: each token's `[kv_heads, head_dim]` key and value into its
    slot, two row copies per token and KV head (torch's index_copy_ pair took about 20 us per layer and
    step at W3's decode batch, most of it the op's own overhead). `key`/`value` `[tokens, kv_heads,
    head_dim]` may be strided views with unit stride within a head; caches contiguous; slots int64."""
    library = _kernels.get(key.dtype)
    num_kv_heads, num_blocks, block_size, head_dim = key_cache.shape
    if not (key.dtype == value.dtype == key_cache.dtype == value_cache.dtype) or key.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"store_kv runs float32 or bfloat16 throughout, got key {key.dtype}, value {value.dtype}, "
                         f"caches {key_cache.dtype}/{value_cache.dtype}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous() and slot_mapping.is_contiguous()) \
            or slot_mapping.dtype != torch.int64 or key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("store_kv needs contiguous caches, int64 contiguous slots and unit stride within a head")
    tokens = slot_mapping.numel()
    if key.shape != (tokens, num_kv_heads, head_dim) or value.shape != key.shape or value_cache.shape != key_cache.shape:
        raise ValueError(f"store_kv: key {tuple(key.shape)} and value {tuple(value.shape)} must be "
                         f"[{tokens} slots, {num_kv_heads} KV heads, {head_dim}], caches alike")
    status = library.store_kv(key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0),
                               value.stride(1), key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(),
                               tokens, num_kv_heads, num_blocks, block_size, head_dim, key.element_size())
    if status != 0:
        raise IndexError(f"store_kv: slots {int(slot_mapping.min())}..{int(slot_mapping.max())} reach outside the "
                         f"cache's {num_blocks * block_size} slots; nothing was stored")
