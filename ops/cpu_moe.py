"""The mixture-of-experts op on CPU: tokens grouped per expert, each expert's two GEMMs run once on its group.

`fused_moe_cpu(hidden, router_logits, experts, config)` computes what `fused_moe_reference` (ops/fused_moe.py)
does, with the same routing (`select_experts`). Where the reference, per expert, compares every routing slot with the
expert's id, gathers its tokens, runs a chain of ops and adds the result into the output (a dozen torch ops
and a host synchronisation per expert, for every expert of the layer), here, for up to
`cpu_moe_decode.TOKENS` tokens (decode), one C call does all that follows the routing (ops/cpu_moe_decode.py,
with the same arithmetic as steps 2 and 4 below); for more:

1. the (token, slot) pairs are sorted by expert once (a C counting sort: one host read of the counts);
2. the experts with at most SMALL_ROWS rows run in one C call (`moe_small_experts`, dot products streaming
   each weight once); in bfloat16 with AMX, the experts packed for it (`amx_pack`, small experts) run all the
   others in one C call (`moe_amx_experts`: threads take whole experts, gather their rows into scratch that
   stays in cache, two GEMMs on AMX tiles and the activation between);
3. any other expert gathers its rows (`index_select`) and runs gate-up, activation, down: three calls;
4. one C kernel (`moe_combine`) sums each token's k expert outputs times their router weights in float32,
   reading the experts' outputs where they lie (no concatenation), and rounds once to the model dtype.

The GEMMs go through `experts.gate_up(e, x)` and `experts.down(e, x)`:
- `DenseExperts`: float32 or bfloat16 weights, each expert's matrices reordered once for oneDNN's matmul
  (the layout asyncengine/models/layers/cpu_gemm.py uses for the dense layers; a decode-sized bfloat16
  GEMM on it takes about half the time of F.linear on the plain weight). The reordered copies sit beside the
  plain weights, so experts take twice their bytes; without oneDNN, F.linear on the plain weights.
- `BlockExperts`: GGUF-style int8 blocks of 32 with a scale (and offset) each (ops/cpu_block_int8.py), per
  expert, through that file's VNNI kernel: each expert's activations are quantized per block of 32 as that
  kernel does for a dense layer, so the result is that of the dequantized experts up to that quantization.

The activation between is ops/cpu_fused.py's SiLU-and-multiply kernel (`silu`), or torch (`swigluoai`).
The combine kernel is built like the other C kernels (ops/cpu_build.py); without it, torch does the same sums.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TypeGuard
from itertools import accumulate
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncengine.ops import cpu_block_int8, cpu_fused, cpu_moe_decode
from asyncengine.ops.cpu_build import AVX512_BF16, AVX512_EXP, C_PRELUDE, KernelLibrary
from asyncengine.ops.fused_moe import MoeConfig, activate, check_arguments, select_experts

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# The rows oneDNN is told to expect when reordering a weight: the layout serves any row count.
ROWS_HINT = 32

def _tile_kernels() -> str:
    """C source of `tile_dots` and its per-row-count kernels (see the comment above it in C_SOURCE)."""
    def kernel(dtype: str, rows: int) -> str:
        bf16 = dtype == "bf16"
        ctype, step, vec = ("uint16_t", 32, "__m512bh") if bf16 else ("float", 16, "__m512")
        mask_type, full = ("__mmask32", "0xffffffffu") if bf16 else ("__mmask16", "0xffffu")
        load = "(__m512bh)_mm512_maskz_loadu_epi16(m, {p} + k)" if bf16 else "_mm512_maskz_loadu_ps(m, {p} + k)"
        fma = "_mm512_dpbf16_ps({a}, {x}, {w})" if bf16 else "_mm512_fmadd_ps({x}, {w}, {a})"
        acc = [(i, j) for i in range(rows) for j in range(4)]
        lines = [f"static void tile_{dtype}_{rows}(const {ctype} *x, int64_t xs, const {ctype} *w, int64_t ws, int no, "
                 f"int64_t K, float out[RT][OT]) {{"]
        lines += [f"    const {ctype} *x{i} = x + {i} * xs;" for i in range(rows)]
        lines += [f"    const {ctype} *w{j} = w + ({j} < no ? {j} : no - 1) * ws;" for j in range(4)]
        lines += [f"    __m512 a{i}{j} = _mm512_setzero_ps();" for i, j in acc]
        lines += [f"    for (int64_t k = 0; k < K; k += {step}) {{",
                  f"        const {mask_type} m = K - k >= {step} ? ({mask_type}){full} : "
                  f"({mask_type})((1u << (K - k)) - 1u);"]
        # The weight rows two output tiles ahead, fetched now (a prefetch never faults past the matrix): the rows
        # are short (K elements), so the hardware's stream detection alone leaves the first lines of each waiting.
        lines += [f"        _mm_prefetch((const char *)(w{j} + 8 * ws + k), _MM_HINT_T0);" for j in range(4)]
        lines += [f"        const {vec} v{j} = {load.format(p=f'w{j}')};" for j in range(4)]
        for i in range(rows):
            lines.append(f"        {{ const {vec} u = {load.format(p=f'x{i}')};")
            lines += [f"          a{i}{j} = {fma.format(a=f'a{i}{j}', x='u', w=f'v{j}')};" for j in range(4)]
            lines.append("        }")
        lines.append("    }")
        lines += [f"    out[{i}][{j}] = _mm512_reduce_add_ps(a{i}{j});" for i, j in acc]
        return "\n".join(lines + ["}"])

    guard = {"bf16": "defined(__AVX512BF16__) && defined(__AVX512BW__)", "f32": "defined(__AVX512F__)"}
    parts = []
    for dtype in ("bf16", "f32"):
        parts.append(f"#if {guard[dtype]}")
        parts += [kernel(dtype, rows) for rows in range(1, 5)]
        parts.append("#endif")
    dispatch = []
    for dtype, flag in (("bf16", "is_bf16"), ("f32", "!is_bf16")):
        ctype = "uint16_t" if dtype == "bf16" else "float"
        dispatch += [f"#if {guard[dtype]}", f"    if ({flag}) {{", "        switch (nr) {"]
        dispatch += [f"        case {rows}: tile_{dtype}_{rows}((const {ctype} *)x, xs, (const {ctype} *)w, ws, no, K, "
                     f"out); return;" for rows in range(1, 5)]
        dispatch += ["        }", "    }", "#endif"]
    parts.append("static void tile_dots(const void *x, int64_t xs, int nr, const void *w, int64_t ws, int no, "
                 "int64_t K, int is_bf16, float out[RT][OT]) {")
    parts += dispatch
    parts += ["    for (int i = 0; i < nr; i++) {",
              "        for (int j = 0; j < OT; j++) {",
              "            const int64_t xi = i * xs, wj = (j < no ? j : no - 1) * ws;",
              "            float s = 0.0f;",
              "            for (int64_t k = 0; k < K; k++) s += load(x, xi + k, is_bf16) * load(w, wj + k, is_bf16);",
              "            out[i][j] = s;",
              "        }",
              "    }",
              "}"]
    return "\n".join(parts)


C_SOURCE = C_PRELUDE + AVX512_EXP + r"""
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
""" + AVX512_BF16 + r"""
#endif


/* A tile of dot products: out[i][j] = x_i . w_j over K, for nr <= RT rows of x and OT rows of w (row strides xs,
   ws, in elements); outputs past no repeat the last valid one (computed, not stored by the caller). One
   function per row count, generated (`_tile_kernels` in cpu_moe.py) with every accumulator a variable of its
   own, so that they stay in registers. bfloat16 products are exact in float32 (vdpbf16ps); the sums are float32,
   in an order of their own. */
#define RT 4
#define OT 4
""" + _tile_kernels() + r"""

/* rows [r0, r0 + nr) of `a` (K wide) times rows [0, outs) of one expert's matrix w (outs x K), plus bias, each
   result rounded to the dtype, into dst (float32 when dst_f32, else the dtype; row stride ldd). Output tiles
   outermost, so that each tile of weights is read from memory once and reused from L1 for every row tile. */
static void expert_gemm(const void *a, int64_t r0, int64_t nrows, const void *w, const void *bias, int64_t outs,
                        int64_t K, void *dst, int64_t ldd, int dst_f32, int is_bf16) {
    const int64_t elem = is_bf16 ? 2 : 4;
    for (int64_t o0 = 0; o0 < outs; o0 += OT) {
        const int no = (int)(outs - o0 < OT ? outs - o0 : OT);
        for (int64_t r = r0; r < r0 + nrows; r += RT) {
            const int nr = (int)(r0 + nrows - r < RT ? r0 + nrows - r : RT);
            float out[RT][OT];
            tile_dots((const char *)a + r * K * elem, K, nr, (const char *)w + o0 * K * elem, K, no, K, is_bf16, out);
            for (int i = 0; i < nr; i++) {
                for (int j = 0; j < no; j++) {
                    float v = out[i][j];
                    if (bias) v += load(bias, o0 + j, is_bf16);
                    v = in_dtype(v, is_bf16);
                    if (dst_f32) ((float *)dst)[(r + i) * ldd + o0 + j] = v;
                    else store(dst, (r + i) * ldd + o0 + j, v, is_bf16);
                }
            }
        }
    }
}

/* The activation of rows [r0, r0 + nrows): gu (float32, [*, 2I], values already in the dtype) -> act (dtype,
   [*, I]); 0: silu(gate) * up, 1: GPT-OSS's clamped swiglu; each op's result rounded as torch's ops round. */
static void expert_activation(const float *gu, int64_t r0, int64_t nrows, int64_t I, int activation, float alpha,
                              float limit, void *act, int64_t lda, int is_bf16) {
    for (int64_t r = r0; r < r0 + nrows; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        int64_t i = 0;
#if defined(__AVX512F__)
        if (activation == 0) {
            const __m512 one = _mm512_set1_ps(1.0f);
            for (; i + 16 <= I; i += 16) {
                const __m512 gv = _mm512_loadu_ps(g + i);
                const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
                if (is_bf16)  /* silu rounded, times up, rounded: as the scalar loop below */
                    _mm256_storeu_si256((__m256i *)((uint16_t *)act + r * lda + i),
                                        narrow16(_mm512_mul_ps(round16(s), _mm512_loadu_ps(u + i))));
                else
                    _mm512_storeu_ps((float *)act + r * lda + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
            }
        }
#endif
        for (; i < I; i++) {
            float v;
            if (activation == 0) {
                v = in_dtype(g[i] / (1.0f + expf(-g[i])), is_bf16) * u[i];
            } else {
                const float gate = g[i] < limit ? g[i] : limit;
                const float up = u[i] < -limit ? -limit : (u[i] > limit ? limit : u[i]);
                const float scaled = in_dtype(gate * alpha, is_bf16);
                const float sig = in_dtype(1.0f / (1.0f + expf(-scaled)), is_bf16);
                v = in_dtype(up + 1.0f, is_bf16) * in_dtype(gate * sig, is_bf16);
            }
            store(act, r * lda + i, v, is_bf16);
        }
    }
}

/* The experts of a small batch in one call: each expert e with count[e] > 0 (its rows of x from start[e], in the
   dtype, H wide) runs gate_up = x_e W13[e]^T (+ b13[e]) rounded to the dtype (gu: float32 scratch [n, 2I]),
   the activation into act (dtype, [n, I]), then y_e = act_e W2[e]^T (+ b2[e]) rounded to the dtype into y
   (dtype, [n, H]). Rows of experts with count 0 are not touched. Threads take whole experts, so they never
   wait for each other until the end (a barrier costs a scheduling slice on a machine others keep busy). */
int moe_small_experts(const void *x, int64_t n, int64_t H, int64_t I, int64_t experts, const int64_t *start,
                      const int64_t *count, const void *w13, const void *w2, const void *b13, const void *b2,
                      int activation, float alpha, float limit, float *gu, void *act, void *y, int is_bf16,
                      int threads) {
    const int64_t elem = is_bf16 ? 2 : 4;
    int64_t active = 0;
    for (int64_t e = 0; e < experts; e++) active += count[e] > 0;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if(active > 1)
    for (int64_t e = 0; e < experts; e++) {
        if (count[e] <= 0) continue;
        expert_gemm(x, start[e], count[e], (const char *)w13 + e * 2 * I * H * elem,
                    b13 ? (const char *)b13 + e * 2 * I * elem : NULL, 2 * I, H, gu, 2 * I, 1, is_bf16);
        expert_activation(gu, start[e], count[e], I, activation, alpha, limit, act, I, is_bf16);
        expert_gemm(act, start[e], count[e], (const char *)w2 + e * H * I * elem,
                    b2 ? (const char *)b2 + e * H * elem : NULL, H, I, y, H, 0, is_bf16);
    }
    return 0;
}

/* AMX (Sapphire Rapids on): each expert's GEMMs on tiles of 16 rows x 32 bfloat16 products, a 16 x 16 float32
   block per instruction, 16 times the work of a vdpbf16ps. The weights are packed once (`amx_pack` in
   cpu_moe.py) into the tile layout: per 16 outputs and 32 inputs, 16 rows of (16 outputs x 2 inputs), 1 KiB. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1

/* Linux hands a process the AMX register state only on request (once per process). */
static int amx_permitted(void) {
    static int state = 0;  /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state > 0;
}

struct tile_config { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

static void amx_configure(void) {  /* per thread: tiles 0-7 all 16 rows x 64 bytes */
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

/* dst[r, :] = a[r, :] W^T (+ bias) for r < nrows, each value rounded to bfloat16 (held as float32 in dst for
   AMX_F32, else stored as bfloat16; for AMX_SILU_GLU, W the gate rows then the up rows, dst gets silu(gate) * up,
   N / 2 wide); a: bfloat16, row stride lda, readable up to the next multiple of 32 rows
   (the rows past nrows are computed and dropped); W: N x K packed, N a multiple of 32, K of 32. Tiles 0-3: two
   row blocks times two output blocks of float32 sums; 4-5: the row blocks' inputs; 6-7: the output blocks'
   weights. Output blocks outermost, and KSTEP x 32 inputs at a time: those weights (32 KiB) stay in L1 while
   every row (nrows <= CHUNK) passes, the sums kept in c between. */
#define CHUNK 256
#define KSTEP 16
#define AMX_BF16 0
#define AMX_F32 1
#define AMX_SILU_GLU 2
static inline __m512 amx_round(__m512 v) {  /* v rounded to bfloat16 (nearest even), held as float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

static void amx_gemm(const uint16_t *a, int64_t lda, int64_t nrows, const uint16_t *wp, const uint16_t *bias,
                     int64_t N, int64_t K, void *dst, int64_t ldd, int mode) {
    const int64_t KB = K / 32, half = N / 2;
    const int glu = mode == AMX_SILU_GLU, dst_f32 = mode == AMX_F32;
    float c[CHUNK][32];  /* the sums of the current 32 outputs, every row */
    for (int64_t n0 = 0; n0 < (glu ? half : N); n0 += glu ? 16 : 32) {
        /* AMX_SILU_GLU: gate outputs n0.. and the matching up outputs half + n0.. side by side */
        const uint16_t *b0 = wp + (n0 / 16) * KB * 512, *b1 = glu ? wp + ((half + n0) / 16) * KB * 512 : b0 + KB * 512;
        for (int64_t k0 = 0; k0 < KB; k0 += KSTEP) {
            const int64_t k1 = k0 + KSTEP < KB ? k0 + KSTEP : KB;
            for (int64_t m0 = 0; m0 < nrows; m0 += 32) {
                const int two = nrows - m0 > 16;
                if (k0 == 0) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                } else {
                    _tile_loadd(0, &c[m0][0], 128);
                    _tile_loadd(1, &c[m0][16], 128);
                    _tile_loadd(2, &c[m0 + 16][0], 128);
                    _tile_loadd(3, &c[m0 + 16][16], 128);
                }
                for (int64_t kb = k0; kb < k1; kb++) {
                    _tile_loadd(4, a + m0 * lda + kb * 32, lda * 2);
                    _tile_loadd(6, b0 + kb * 512, 64);
                    _tile_loadd(7, b1 + kb * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (two) {
                        _tile_loadd(5, a + (m0 + 16) * lda + kb * 32, lda * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, &c[m0][0], 128);
                _tile_stored(1, &c[m0][16], 128);
                _tile_stored(2, &c[m0 + 16][0], 128);
                _tile_stored(3, &c[m0 + 16][16], 128);
            }
        }
        if (glu) {  /* silu(gate) * up, each step rounded as expert_activation rounds it */
            for (int64_t i = 0; i < nrows; i++) {
                __m512 g = _mm512_loadu_ps(&c[i][0]), u = _mm512_loadu_ps(&c[i][16]);
                if (bias) {
                    g = _mm512_add_ps(g, widen16(bias + n0));
                    u = _mm512_add_ps(u, widen16(bias + half + n0));
                }
                g = amx_round(g);
                u = amx_round(u);
                const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                   exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
                _mm256_storeu_si256((__m256i *)((uint16_t *)dst + i * ldd + n0),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(amx_round(silu), u)));
            }
            continue;
        }
        for (int64_t i = 0; i < nrows; i++) {
            for (int h = 0; h < 2; h++) {
                __m512 v = _mm512_loadu_ps(&c[i][16 * h]);
                if (bias) v = _mm512_add_ps(v, widen16(bias + n0 + 16 * h));
                const __m256i r = (__m256i)_mm512_cvtneps_pbh(v);  /* to nearest even, as narrow16 */
                if (dst_f32)
                    _mm512_storeu_ps((float *)dst + i * ldd + n0 + 16 * h,
                                     _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
                else
                    _mm256_storeu_si256((__m256i *)((uint16_t *)dst + i * ldd + n0 + 16 * h), r);
            }
        }
    }
}
#endif

/* The experts with count[e] > 0 on AMX, bfloat16: expert e's rows are tokens rows[start[e]..] of x (H wide);
   gate_up = x_e W13[e]^T (+ b13[e]) rounded to bfloat16, the activation, y_e = act W2[e]^T (+ b2[e]) rounded to
   bfloat16 into y's rows start[e].. (H wide). w13p, w2p: the packed weights, [E] x 2I x H and [E] x H x I.
   Threads take whole experts (dynamically); each gathers its expert's rows, CHUNK at a time, into scratch of
   its own that stays in cache for both GEMMs. Returns 0; 1 where this build or the OS has no AMX; -1 when
   scratch memory could not be allocated. */

/* 1 where moe_amx_experts runs (built with AMX, and the OS grants it), else 0. */
int moe_amx_ready(void) {
#if defined(HAVE_AMX)
    return amx_permitted();
#else
    return 0;
#endif
}

int moe_amx_experts(const uint16_t *x, const int64_t *rows, int64_t H, int64_t I, int64_t experts,
                    const int64_t *start, const int64_t *count, const uint16_t *w13p, const uint16_t *w2p,
                    const uint16_t *b13, const uint16_t *b2, int activation, float alpha, float limit, uint16_t *y,
                    int threads) {
#if defined(HAVE_AMX)
    if (!amx_permitted()) return 1;
    int64_t active = 0;
    for (int64_t e = 0; e < experts; e++) active += count[e] > 0;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if(active > 1)
    {
        /* Row strides one cache line longer than the rows: a tile's 16 rows then fall in different L1 sets (H and I
           are often powers of two). */
        const int64_t xld = H + 32, ald = I + 32;
        uint16_t *xs = malloc(sizeof(uint16_t) * CHUNK * xld), *act = malloc(sizeof(uint16_t) * CHUNK * ald);
        float *gu = malloc(sizeof(float) * CHUNK * 2 * I);
        const int ok = xs && act && gu;
        if (ok) {
            amx_configure();
            /* the rows past a chunk's last (read by its last tile, their results dropped): zeros, not stale NaNs */
            memset(xs, 0, sizeof(uint16_t) * CHUNK * xld);
            memset(act, 0, sizeof(uint16_t) * CHUNK * ald);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < experts; e++) {
            if (count[e] <= 0) continue;
            if (!ok) { failed = 1; continue; }
            for (int64_t r0 = 0; r0 < count[e]; r0 += CHUNK) {
                const int64_t n = count[e] - r0 < CHUNK ? count[e] - r0 : CHUNK, first = start[e] + r0;
                for (int64_t r = 0; r < n; r++) memcpy(xs + r * xld, x + rows[first + r] * H, sizeof(uint16_t) * H);
                const uint16_t *w13e = w13p + e * 2 * I * H, *b13e = b13 ? b13 + e * 2 * I : NULL;
                if (activation == 0) {  /* SiLU: straight from the gate-up sums, no float32 round trip */
                    amx_gemm(xs, xld, n, w13e, b13e, 2 * I, H, act, ald, AMX_SILU_GLU);
                } else {
                    amx_gemm(xs, xld, n, w13e, b13e, 2 * I, H, gu, 2 * I, AMX_F32);
                    expert_activation(gu, 0, n, I, activation, alpha, limit, act, ald, 1);
                }
                amx_gemm(act, ald, n, w2p + e * H * I, b2 ? b2 + e * H : NULL, H, I, y + first * H, H, AMX_BF16);
            }
        }
        if (ok) _tile_release();
        free(xs); free(act); free(gu);
    }
    return failed ? -1 : 0;
#else
    (void)x; (void)rows; (void)H; (void)I; (void)experts; (void)start; (void)count; (void)w13p; (void)w2p;
    (void)b13; (void)b2; (void)activation; (void)alpha; (void)limit; (void)y; (void)threads;
    return 1;
#endif
}

/* A stable counting sort of the (token, slot) pairs by local expert: ids[p] in [0, experts) (anything else goes
   to bin `experts`, after all). Out: order (the pairs, grouped), counts[experts + 1], position[p] (p's index in
   order). */
void moe_group(const int64_t *ids, int64_t pairs, int64_t experts, int64_t *order, int64_t *counts,
               int64_t *position) {
    for (int64_t e = 0; e <= experts; e++) counts[e] = 0;
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t e = ids[p] >= 0 && ids[p] < experts ? ids[p] : experts;
        counts[e]++;
    }
    int64_t next[experts + 1];
    int64_t at = 0;
    for (int64_t e = 0; e <= experts; e++) { next[e] = at; at += counts[e]; }
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t e = ids[p] >= 0 && ids[p] < experts ? ids[p] : experts;
        position[p] = next[e];
        order[next[e]++] = p;
    }
}

/* out[m, :] = sum over j < k of w[m*k+j] * y_e[row, :], the row of pair (m, j) in its expert's output:
   e = expert[m*k+j] (a pair whose expert is not held here has e < 0 or e >= experts and adds nothing),
   row = pos[m*k+j] - start[e], y_e at address base[e] with rows of `width` elements. Sums in float32, in
   slot order j = 0..k-1, rounded once to the dtype. */
int moe_combine(void *out, int64_t tokens, int64_t width, int64_t k, const int64_t *expert, const int64_t *pos,
                const float *w, const int64_t *start, const int64_t *base, int64_t experts, int is_bf16,
                int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if(tokens * k * width >= 65536)
    for (int64_t m = 0; m < tokens; m++) {
        float acc[512];
        for (int64_t c0 = 0; c0 < width; c0 += 512) {
            const int64_t n = width - c0 < 512 ? width - c0 : 512;
            for (int64_t c = 0; c < n; c++) acc[c] = 0.0f;
            for (int64_t j = 0; j < k; j++) {
                const int64_t pair = m * k + j, e = expert[pair];
                if (e < 0 || e >= experts) continue;
                const int64_t row = pos[pair] - start[e];
                const float wt = w[pair];
                if (is_bf16) {
                    const uint16_t *y = (const uint16_t *)(intptr_t)base[e] + row * width + c0;
                    #pragma omp simd
                    for (int64_t c = 0; c < n; c++) acc[c] += wt * bf(y[c]);
                } else {
                    const float *y = (const float *)(intptr_t)base[e] + row * width + c0;
                    #pragma omp simd
                    for (int64_t c = 0; c < n; c++) acc[c] += wt * y[c];
                }
            }
            if (is_bf16) {
                uint16_t *o = (uint16_t *)out + m * width + c0;
                for (int64_t c = 0; c < n; c++) o[c] = to_bf(acc[c]);
            } else {
                memcpy((float *)out + m * width + c0, acc, n * sizeof(float));
            }
        }
    }
    return 0;
}
""" + cpu_moe_decode.C_SOURCE  # the one-call path for a few tokens, on the dot-product kernels above

# -ffp-contract=off: each product is rounded before it is added, as torch's multiply then add do.
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"],
              ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"])
_P, _I = ctypes.c_void_p, ctypes.c_int64


def _declare(library: ctypes.CDLL) -> None:
    library.moe_combine.restype = library.moe_small_experts.restype = library.moe_amx_experts.restype = ctypes.c_int
    library.moe_amx_experts.argtypes = [_P, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P, ctypes.c_int, ctypes.c_float,
                                        ctypes.c_float, _P, ctypes.c_int]
    library.moe_amx_ready.restype = ctypes.c_int
    library.moe_amx_ready.argtypes = []
    library.moe_group.restype = None
    library.moe_group.argtypes = [_P, _I, _I, _P, _P, _P]
    library.moe_combine.argtypes = [_P, _I, _I, _I, _P, _P, _P, _P, _P, _I, ctypes.c_int, ctypes.c_int]
    library.moe_small_experts.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, ctypes.c_int, ctypes.c_float,
                                          ctypes.c_float, _P, _P, _P, ctypes.c_int, ctypes.c_int]
    cpu_moe_decode.declare(library)


_kernels = KernelLibrary("cpu_moe", C_SOURCE, _FLAG_SETS, _declare, dtypes=SUPPORTED_DTYPES,
                         what="MoE combine kernel", fallback="the MoE op sums the experts' outputs with torch")


def available(dtype: torch.dtype) -> bool:
    """Whether the combine kernel runs for `dtype` (compiling it on first use)."""
    return _kernels.available(dtype)


def unavailable_reason() -> str | None:
    return _kernels.unavailable_reason()


def onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` `[out, in]` reordered for oneDNN's matmul, or None where torch cannot (no oneDNN, a dtype
    its build lacks on this CPU): F.linear on the plain weight serves then."""
    if weight.device.type != "cpu" or weight.dtype not in SUPPORTED_DTYPES or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
    except RuntimeError:
        return None


def amx_ready() -> bool:
    """Whether the AMX expert kernel runs here (bfloat16 kernels built with AMX, and the OS grants its registers)."""
    return available(torch.bfloat16) and bool(_kernels.get(torch.bfloat16).moe_amx_ready())


def amx_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """Stacked bfloat16 weights `[E, N, K]` in the AMX kernel's tile layout (per 16 outputs and 32 inputs, 16 rows
    of 16 outputs x 2 inputs), or None where that kernel cannot take them (not bfloat16 on CPU, N or K no multiple
    of 32, no AMX)."""
    experts, outs, ins = weight.shape
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or outs % 32 or ins % 32 or not amx_ready():
        return None
    tiles = weight.detach().reshape(experts, outs // 16, 16, ins // 32, 16, 2)
    return tiles.permute(0, 1, 3, 4, 2, 5).contiguous()


def _linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
            bias: torch.Tensor | None) -> torch.Tensor:
    # One float32 row is faster through F.linear (asyncengine/models/layers/cpu_gemm.py measured it).
    if packed is None or x.dtype != weight.dtype or (x.shape[0] == 1 and x.dtype == torch.float32):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclass
class DenseExperts:
    """Float experts: `w13` `[E, 2I, H]`, `w2` `[E, H, I]`, optional biases, and (from `pack`) each expert's
    matrices reordered for oneDNN."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    packed13: Sequence[torch.Tensor | None] | None = None
    packed2: Sequence[torch.Tensor | None] | None = None
    amx13: torch.Tensor | None = None
    amx2: torch.Tensor | None = None

    @classmethod
    def pack(cls, w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None = None,
             w2_bias: torch.Tensor | None = None, *, amx: bool = True) -> DenseExperts:
        """With the experts' matrices packed (once: keep the result while the weights stay): in AMX tiles where
        the AMX kernel takes them (bfloat16, each expert's gate-up matrix at most AMX_WIDE_BYTES; unless `amx`
        is False), else each reordered for oneDNN."""
        amx = amx and w13[0].numel() * w13.element_size() <= AMX_WIDE_BYTES
        amx13, amx2 = (amx_pack(w13), amx_pack(w2)) if amx else (None, None)
        if amx13 is not None and amx2 is not None:
            return cls(w13, w2, w13_bias, w2_bias, amx13=amx13, amx2=amx2)
        packed13 = [onednn_pack(w) for w in w13]
        packed2 = [onednn_pack(w) for w in w2]
        usable = all(p is not None for p in packed13 + packed2)
        return cls(w13, w2, w13_bias, w2_bias, packed13 if usable else None, packed2 if usable else None)

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.w13[expert], None if self.packed13 is None else self.packed13[expert],
                       None if self.w13_bias is None else self.w13_bias[expert])

    def down(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.w2[expert], None if self.packed2 is None else self.packed2[expert],
                       None if self.w2_bias is None else self.w2_bias[expert])


@dataclass
class BlockExperts:
    """Experts in GGUF-style int8 blocks (ops/cpu_block_int8.py), one packed matrix per expert and projection:
    `gate_up[e]` has 2I outputs (gate rows, then up rows) over H inputs, `down[e]` H outputs over I inputs.
    The biases, when given, are float (`[E, 2I]`, `[E, H]`)."""

    gate_up_blocks: Sequence[cpu_block_int8.PackedBlocks]
    down_blocks: Sequence[cpu_block_int8.PackedBlocks]
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return len(self.gate_up_blocks)

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        y = cpu_block_int8.linear(x, self.gate_up_blocks[expert])
        return y if self.w13_bias is None else y + self.w13_bias[expert]

    def down(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        y = cpu_block_int8.linear(x, self.down_blocks[expert])
        return y if self.w2_bias is None else y + self.w2_bias[expert]


Experts = DenseExperts | BlockExperts


def supported(hidden: torch.Tensor, experts: Experts) -> bool:
    """Whether `fused_moe_cpu` takes these: CPU tensors in float32 or bfloat16, float weights of that dtype
    (or int8 blocks, where the block kernel is built)."""
    if hidden.device.type != "cpu" or hidden.dtype not in SUPPORTED_DTYPES:
        return False
    if isinstance(experts, BlockExperts):
        return cpu_block_int8.available(hidden.dtype)
    return experts.w13.dtype == experts.w2.dtype == hidden.dtype and experts.w13.device.type == "cpu"


def _activate(gate_up: torch.Tensor, config: MoeConfig) -> torch.Tensor:
    if config.activation == "silu" and cpu_fused.silu_and_mul_supported(gate_up):
        return cpu_fused.silu_and_mul(gate_up)
    return activate(gate_up, config)


# An expert with at most this many rows in a call runs in the C kernel for small batches (`moe_small_experts`:
# all such experts in one call, vdpbf16ps/FMA dot products streaming each weight once); above it, oneDNN's
# matmul (AMX on bfloat16 here) on the expert's rows is faster than the dot products, and its per-call cost is
# spread over enough rows.
SMALL_ROWS = 4


# Experts packed for AMX (`DenseExperts.pack`: those whose gate-up matrix is at most AMX_WIDE_BYTES, Qwen3-MoE's
# and OLMoE's) run every expert that the small-batch kernel does not take in the AMX kernel: its threads take
# whole experts, each gathering its rows 256 at a time (the C kernel's CHUNK) into scratch that stays in cache.
# Against oneDNN's matmul per expert (one thread, CPU time, bench/moe.py's shapes, under load): 1.6-2.7x
# faster at 64 tokens, 1.35-1.8x at 512, the same to 1.8x at 2048; and oneDNN ran the small experts' gate-up
# GEMM of 512 rows on one thread of two, where the AMX kernel splits the experts. Wider experts (Mixtral's)
# keep oneDNN: a few experts of many rows keep few threads busy and re-read a wide matrix per chunk (0.85x at
# 512-2048 tokens), and a third copy of such weights would cost more memory than the 1.25x it gained at 16-64.
AMX_WIDE_BYTES = 4 << 20


def _dot_kernels_take(experts: Experts, hidden: torch.Tensor) -> TypeGuard[DenseExperts]:
    """Whether the C dot-product kernels (`moe_small_experts`, `moe_decode`) take these experts: plain
    contiguous weights (and biases) of hidden's dtype, the kernels built."""
    return (isinstance(experts, DenseExperts) and experts.w13.is_contiguous() and experts.w2.is_contiguous()
            and (experts.w13_bias is None or experts.w13_bias.is_contiguous())
            and (experts.w2_bias is None or experts.w2_bias.is_contiguous())
            and experts.w13.dtype == hidden.dtype and available(hidden.dtype))


def _small_experts(experts: Experts, counts: list[int], hidden: torch.Tensor) -> list[int]:
    """Per expert, its row count where the small-batch kernel takes it, else 0."""
    if not _dot_kernels_take(experts, hidden):
        return [0] * len(counts)
    return [count if count <= SMALL_ROWS else 0 for count in counts]


def _run_small_experts(x: torch.Tensor, experts: DenseExperts, small: list[int],
                       config: MoeConfig) -> tuple[torch.Tensor, list[int]]:
    """`moe_small_experts` on the experts `small` names, x holding their rows in expert order: (their outputs, in
    x's row order; each expert's first row in x)."""
    rows, width = x.shape
    inner = experts.w2.shape[2]
    offsets = [0, *accumulate(small[:-1])]
    y = torch.empty((rows, width), dtype=x.dtype)
    scratch = torch.empty((rows, 2 * inner), dtype=torch.float32)
    activated = torch.empty((rows, inner), dtype=x.dtype)
    array = ctypes.c_int64 * len(small)
    status = _kernels.get(x.dtype).moe_small_experts(
        x.data_ptr(), rows, width, inner, len(small), array(*offsets), array(*small), experts.w13.data_ptr(),
        experts.w2.data_ptr(), None if experts.w13_bias is None else experts.w13_bias.data_ptr(),
        None if experts.w2_bias is None else experts.w2_bias.data_ptr(), int(config.activation == "swigluoai"),
        config.swiglu_alpha, config.swiglu_limit, scratch.data_ptr(), activated.data_ptr(), y.data_ptr(),
        int(x.dtype == torch.bfloat16), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"moe_small_experts failed with status {status}")
    return y, offsets


def _amx_experts(experts: Experts, counts: list[int], small: list[int], hidden: torch.Tensor) -> list[int]:
    """Per expert, its row count where the AMX kernel takes it (every expert with rows that the small-batch
    kernel does not take, where the experts are packed for it), else 0."""
    if not (isinstance(experts, DenseExperts) and experts.amx13 is not None and experts.amx2 is not None
            and hidden.dtype == torch.bfloat16 and available(torch.bfloat16)
            and all(b is None or (b.dtype == torch.bfloat16 and b.is_contiguous())
                    for b in (experts.w13_bias, experts.w2_bias))):
        return [0] * len(counts)
    return [0 if small[expert] else count for expert, count in enumerate(counts)]


def _run_amx_experts(hidden: torch.Tensor, rows: torch.Tensor, experts: DenseExperts, firsts: list[int],
                     amx: list[int], config: MoeConfig) -> torch.Tensor:
    """`moe_amx_experts` on the experts `amx` names (expert e's tokens: rows[firsts[e]:][:amx[e]]): their
    outputs, each expert's from row firsts[e] (the rows of other experts are not written)."""
    if experts.amx13 is None or experts.amx2 is None:
        raise ValueError("_run_amx_experts needs experts packed for AMX (DenseExperts.pack on bfloat16 weights)")
    width, inner = hidden.shape[1], experts.w2.shape[2]
    hidden = hidden.contiguous()
    y = torch.empty((rows.numel(), width), dtype=torch.bfloat16)
    array = ctypes.c_int64 * len(amx)
    status = _kernels.get(torch.bfloat16).moe_amx_experts(
        hidden.data_ptr(), rows.data_ptr(), width, inner, len(amx), array(*firsts), array(*amx),
        experts.amx13.data_ptr(), experts.amx2.data_ptr(),
        None if experts.w13_bias is None else experts.w13_bias.data_ptr(),
        None if experts.w2_bias is None else experts.w2_bias.data_ptr(), int(config.activation == "swigluoai"),
        config.swiglu_alpha, config.swiglu_limit, y.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"moe_amx_experts failed with status {status} (1: no AMX, -1: out of memory)")
    return y


def _run_other_experts(hidden: torch.Tensor, rows: torch.Tensor, experts: Experts, counts: list[int],
                       firsts: list[int], small: list[int], config: MoeConfig, bases: list[int],
                       outputs: list[tuple[int, torch.Tensor]]) -> torch.Tensor | None:
    """The experts with rows that the small-batch kernel did not take: those packed for AMX in one call of the
    AMX kernel, any other through oneDNN. Sets their `bases` (the address of each expert's first output row),
    appends the oneDNN experts' outputs, (first grouped position, rows), to `outputs` and returns the AMX
    kernel's (None without): the caller keeps both alive for the combine."""
    amx = _amx_experts(experts, counts, small, hidden)
    y_amx = None
    if any(amx):
        y_amx = y = _run_amx_experts(hidden, rows, experts, firsts, amx, config)
        row_bytes = y.stride(0) * y.element_size()
        for expert in range(len(counts)):
            if amx[expert]:
                bases[expert] = y.data_ptr() + firsts[expert] * row_bytes
    for expert, count in enumerate(counts):
        first = firsts[expert]
        if count and not small[expert] and not amx[expert]:
            # Each expert's rows gathered just before its GEMMs: a block that stays in cache for them, where one
            # gather of every pair (tokens x k rows, tens of MB at prefill sizes) came back from the allocator as
            # fresh pages each call and cost a fifth of the op (4096 tokens, top-8).
            x = hidden.index_select(0, rows[first:first + count])
            y = experts.down(expert, _activate(experts.gate_up(expert, x), config))
            if y.dtype != hidden.dtype or not y.is_contiguous():
                y = y.to(hidden.dtype).contiguous()
            bases[expert] = y.data_ptr()
            outputs.append((first, y))
    return y_amx


def fused_moe_cpu(hidden: torch.Tensor, router_logits: torch.Tensor, experts: Experts, config: MoeConfig,
                  expert_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_moe_reference` with the tokens grouped per expert (see the module's docstring). With
    `expert_tokens` (int64, one entry per expert of the model), each token's chosen experts are counted into it."""
    if isinstance(experts, DenseExperts):
        check_arguments(hidden, router_logits, experts.w13, experts.w2, experts.w13_bias, experts.w2_bias, config)
    tokens, width = hidden.shape
    if tokens == 0:
        return torch.empty((0, width), dtype=hidden.dtype)
    weights, ids = select_experts(router_logits, config)
    if cpu_moe_decode.takes(tokens, config.top_k) and _dot_kernels_take(experts, hidden):  # decode: one C call
        counter = expert_tokens
        if counter is not None and not (counter.device.type == "cpu" and counter.dtype == torch.int64
                                        and counter.is_contiguous()):
            _count(counter, ids)
            counter = None
        return cpu_moe_decode.run(_kernels.get(hidden.dtype), hidden, weights, ids, experts.w13, experts.w2,
                                  experts.w13_bias, experts.w2_bias, config, counter)
    if expert_tokens is not None:
        _count(expert_tokens, ids)
    num_experts = experts.num_experts
    k = ids.shape[1]
    # Local expert ids; a pair whose expert another rank holds goes last and is never run.
    local = (ids - config.first_expert).reshape(-1)
    order, counts, position = _group(local, num_experts)
    firsts = [0, *accumulate(counts[:num_experts - 1])]  # each expert's first position in the grouped order
    rows = order // k  # each grouped pair's token

    starts, bases, outputs = list(firsts), [0] * num_experts, []
    small_outputs = None
    small = _small_experts(experts, counts[:num_experts], hidden)
    all_small = small == counts[:num_experts]  # (decode sizes): nothing else to run, no per-expert loop in Python
    if any(small):  # the experts with few rows, all in one call of the C kernel, on their rows only
        if all_small:  # the grouped rows as they are
            x = hidden.index_select(0, rows[:len(order) - counts[num_experts]])
        else:
            x = hidden.index_select(0, torch.cat([rows[firsts[e]:firsts[e] + small[e]]
                                                  for e in range(num_experts) if small[e]]))
        y, offsets = _run_small_experts(x, experts, small, config)
        small_outputs = y
        row_bytes, base = y.stride(0) * y.element_size(), y.data_ptr()
        # (an expert that is not small gets its own base below; one without rows is never read)
        bases = [base + offset * row_bytes for offset in offsets]
    amx_outputs = None  # (the torch combine never sees these, nor the small ones: both kernels need the C build)
    if not all_small:
        amx_outputs = _run_other_experts(hidden, rows, experts, counts[:num_experts], firsts, small, config, bases,
                                         outputs)

    if not available(hidden.dtype):
        return _combine_with_torch(outputs, order, weights, tokens, k, width, hidden.dtype)
    out = torch.empty((tokens, width), dtype=hidden.dtype)
    weights = weights.reshape(-1).contiguous()
    array = ctypes.c_int64 * num_experts
    _kernels.get(hidden.dtype).moe_combine(
        out.data_ptr(), tokens, width, k, local.data_ptr(), position.data_ptr(), weights.data_ptr(),
        array(*starts), array(*bases), num_experts, int(hidden.dtype == torch.bfloat16), torch.get_num_threads())
    del small_outputs, amx_outputs, outputs  # read by the combine through `bases`: alive until here
    return out


def _count(expert_tokens: torch.Tensor, ids: torch.Tensor) -> None:
    flat = ids.reshape(-1).to(expert_tokens.device)
    expert_tokens.scatter_add_(0, flat, torch.ones_like(flat, dtype=expert_tokens.dtype))


def _group(local: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """(the pairs sorted by local expert, stable; the count per expert, and of pairs held elsewhere last; each
    pair's index in that order). One C call where the kernels are built (torch's sort costs tens of
    microseconds per call at decode sizes), else torch."""
    pairs = local.numel()
    if available(torch.float32):
        local = local.contiguous()
        order, position = torch.empty(pairs, dtype=torch.int64), torch.empty(pairs, dtype=torch.int64)
        counts = (ctypes.c_int64 * (num_experts + 1))()
        _kernels.get(torch.float32).moe_group(local.data_ptr(), pairs, num_experts, order.data_ptr(), counts,
                                              position.data_ptr())
        return order, list(counts), position
    binned = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    order = torch.argsort(binned, stable=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(pairs)
    return order, torch.bincount(binned, minlength=num_experts + 1).tolist(), position


def _combine_with_torch(outputs: list[tuple[int, torch.Tensor]], order: torch.Tensor, weights: torch.Tensor,
                        tokens: int, k: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """What `moe_combine` computes, where it is not built: per token, its k weighted outputs summed in float32.
    (Each output holds the rows of sorted positions start.., written only for the experts it ran.)"""
    pairs = torch.zeros((tokens * k, width), dtype=torch.float32)
    flat_weights = weights.reshape(-1)
    for start, y in outputs:
        rows = order[start:start + y.shape[0]]
        pairs[rows] = y.float() * flat_weights[rows, None]
    return pairs.view(tokens, k, width).sum(dim=1).to(dtype)
