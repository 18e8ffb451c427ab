"""The one-call CPU decode step's products over a GGUF file's blocks (`quantization="gguf"`): the C functions
ops/cpu_decode_step.py includes (`BLOCKS_C`) and the tables of block weights it hands them.

A gguf layer keeps its weights as ops/cpu_block_int8.py packs them: small integers, a scale and an offset per
block of 32 inputs. The step runs each layer's four products (QKV, O, gate-up, down) on them as the layer
does (activations quantized per block of 32, VNNI dot products per block, scaled once), at 8 bits
(PackedBlocks, the layer's own arrays) or, where every integer lies in -8..7 (Q4_0, Q4_1), at 4 bits
(PackedNibbles, made once from those): half the bytes a decode step reads. The embedding, the norms and
the LM head stay the float tensors the gguf method keeps. asyncengine/worker/cpu_decode.py decides when.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, Union

from asyncengine.ops.cpu_block_int8 import BLOCK_INT8_C, PackedBlocks, PackedNibbles

MAX_BLOCK_WIDTH = 16384  # the widest input of a block product (MAX_BLOCK_WIDTH in the C source)

# Inside ops/cpu_decode_step.py's source, after its matvec (PREFETCH_BYTES, load/store/in_dtype, silu_mul_block).
BLOCKS_C = r"""
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define HAS_BLOCKS 1
""" + BLOCK_INT8_C + r"""#else
#define HAS_BLOCKS 0
#endif

/* Products over a GGUF file's quantized weights (`quantization="gguf"`): every 32 inputs of an output row share a
   scale and an offset, the weights are small integers, packed by ops/cpu_block_int8.py's `pack`
   ([N/16, K/4, 16, 4] bytes). The activation rows are quantized per block of 32 once per product (each thread
   quantizes them itself, as it normalizes: no barrier), then each pair of 16-output tiles is VNNI dot products
   per block, scaled once: ops/cpu_block_int8.py's arithmetic (BLOCK_INT8_C, the same code; at 4 bits
   nibble_pair_rows, the same integers and the same float steps), so the products are the module path's values
   exactly, each output rounded to the dtype where the module path's layer rounds it. */
typedef struct {
    const void *q;            /* int8 [N/16, K/4, 16, 4]; with `nibbles`, 4-bit pairs [N/16, K/8, 16, 4] */
    const float *scale, *offset;  /* [N/16, K/32, 16]; offset NULL for none */
    const int32_t *start;     /* [N/16, K/32, 16]: -128 * the block's sum of q (unused with `nibbles`) */
    int64_t nibbles;
} blocks_t;
#define LAYER_BLOCKS(L, i) ((L)->blocks ? (const blocks_t *)(L)->blocks + (i) : NULL)
#define MAX_BLOCK_WIDTH 16384  /* the widest input of a block product: its quantized rows live on the stack */
#if HAS_BLOCKS
/* x's B rows per block of 32 (quantize_block32), with each block's integer sum, sum(xq - 128), in xsum. */
static void quantize_rows(const void *x, int64_t K, int64_t B, int is_bf16, uint8_t *xq, float *dx, float *sx,
                          int32_t *xsum) {
    const int64_t blocks = K / 32, es = is_bf16 ? 2 : 4;
    for (int64_t b = 0; b < B; b++)
        for (int64_t g = 0; g < blocks; g++) {
            uint8_t *q = xq + b * K + g * 32;
            quantize_block32((const char *)x + (b * K + g * 32) * es, is_bf16, q, dx + b * blocks + g,
                             sx + b * blocks + g);
            int32_t sum = -128 * 32;
            for (int i = 0; i < 32; i++) sum += q[i];
            xsum[b * blocks + g] = sum;
        }
}

/* pair_rows over weights of 4 bits (Q4_0, Q4_1, and any block whose integers lie in -8..7), half the bytes: each
   byte holds q + 8 of input k (low nibble) and of input k + 4 (high), so one 64-byte load is 8 inputs of 16
   outputs. The weights are the unsigned side of vpdpbusd, the activations (xq - 128) the signed one, so each sum
   is sum((q + 8) xq), and 8 sum(xq) taken back out leaves sum(q xq) exactly: from there the block is scaled as
   pair_rows scales it, so the products are the module path's values exactly at 4 bits too. */
static inline __attribute__((always_inline)) void nibble_pair_rows(
        const int MR, const uint8_t *w0, const uint8_t *w1, const float *d0, const float *d1, const float *o0,
        const float *o1, const uint8_t *xq, int64_t width, const float *dx, const float *sx, const int32_t *xsum,
        int64_t blocks, __m512 acc[][2]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int r = 0; r < MR; r++) { acc[r][0] = _mm512_setzero_ps(); acc[r][1] = _mm512_setzero_ps(); }
    for (int64_t g = 0; g < blocks; g++) {
        __m512i s[ROWS][2];
        for (int r = 0; r < MR; r++) { s[r][0] = _mm512_setzero_si512(); s[r][1] = _mm512_setzero_si512(); }
        const uint8_t *wg0 = w0 + g * 16 * 16, *wg1 = w1 + g * 16 * 16;
        _mm_prefetch((const char *)(wg0 + PREFETCH_BYTES), _MM_HINT_T0);
        _mm_prefetch((const char *)(wg1 + PREFETCH_BYTES), _MM_HINT_T0);
        for (int k8 = 0; k8 < 4; k8++) {
            const __m512i v0 = _mm512_loadu_si512(wg0 + k8 * 64), v1 = _mm512_loadu_si512(wg1 + k8 * 64);
            const __m512i lo0 = _mm512_and_si512(v0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
            const __m512i lo1 = _mm512_and_si512(v1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
            for (int r = 0; r < MR; r++) {
                uint32_t four[2];
                memcpy(four, xq + r * width + g * 32 + k8 * 8, 8);
                const __m512i xa = _mm512_set1_epi32((int32_t)(four[0] ^ 0x80808080u));
                const __m512i xb = _mm512_set1_epi32((int32_t)(four[1] ^ 0x80808080u));
                s[r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[r][0], lo0, xa), hi0, xb);
                s[r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[r][1], lo1, xa), hi1, xb);
            }
        }
        const __m512 dv0 = _mm512_loadu_ps(d0 + g * 16), dv1 = _mm512_loadu_ps(d1 + g * 16);
        for (int r = 0; r < MR; r++) {
            const __m512i eight = _mm512_set1_epi32(8 * xsum[r * blocks + g]);
            const __m512 xs = _mm512_set1_ps(dx[r * blocks + g]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s[r][0], eight)), _mm512_mul_ps(dv0, xs),
                                        acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s[r][1], eight)), _mm512_mul_ps(dv1, xs),
                                        acc[r][1]);
        }
        add_block_offsets(MR, o0, o1, sx, blocks, g, acc);
    }
}

/* acc[r][0] and acc[r][1]: tiles t0 and t1 (16 outputs each) of w times rows r of the quantized x, for B rows. */
static inline void tile_pair(const blocks_t *w, int64_t t0, int64_t t1, int64_t K, int64_t r0, int rows,
                             const uint8_t *xq, const float *dx, const float *sx, const int32_t *xsum,
                             __m512 acc[][2]) {
    const int64_t blocks = K / 32, at0 = t0 * blocks * 16, at1 = t1 * blocks * 16;
    const uint8_t *x = xq + r0 * K;
    const float *d = dx + r0 * blocks, *s = sx + r0 * blocks;
    const int32_t *xs = xsum + r0 * blocks;
    if (!w->nibbles) {
        const int8_t *q = (const int8_t *)w->q;
        pair_any_rows(rows, q + t0 * K * 16, q + t1 * K * 16, w->scale + at0, w->scale + at1,
                      w->offset ? w->offset + at0 : NULL, w->offset ? w->offset + at1 : NULL, w->start + at0,
                      w->start + at1, x, K, d, s, blocks, acc);
        return;
    }
    const uint8_t *q0 = (const uint8_t *)w->q + t0 * K * 8, *q1 = (const uint8_t *)w->q + t1 * K * 8;
    const float *d0 = w->scale + at0, *d1 = w->scale + at1;
    const float *o0 = w->offset ? w->offset + at0 : NULL, *o1 = w->offset ? w->offset + at1 : NULL;
    switch (rows) {
        case 1: nibble_pair_rows(1, q0, q1, d0, d1, o0, o1, x, K, d, s, xs, blocks, acc); break;
        case 2: nibble_pair_rows(2, q0, q1, d0, d1, o0, o1, x, K, d, s, xs, blocks, acc); break;
        case 3: nibble_pair_rows(3, q0, q1, d0, d1, o0, o1, x, K, d, s, xs, blocks, acc); break;
        case 4: nibble_pair_rows(4, q0, q1, d0, d1, o0, o1, x, K, d, s, xs, blocks, acc); break;
        case 5: nibble_pair_rows(5, q0, q1, d0, d1, o0, o1, x, K, d, s, xs, blocks, acc); break;
        case 6: nibble_pair_rows(6, q0, q1, d0, d1, o0, o1, x, K, d, s, xs, blocks, acc); break;
        default: break;
    }
}

/* out[b, n] = x[b] . w[n] for this thread's share of the N rows, rounded to the dtype, then + bias[n] rounded
   (the gguf layer adds its bias to its rounded output). No barrier. */
static void block_matvec(const void *x, const blocks_t *w, const void *bias, int64_t N, int64_t K, int64_t B,
                         void *out, int is_bf16) {
    const int64_t blocks = K / 32;
    uint8_t xq[B * K];
    float dx[B * blocks], sx[B * blocks];
    int32_t xsum[B * blocks];
    quantize_rows(x, K, B, is_bf16, xq, dx, sx, xsum);
    #pragma omp for schedule(dynamic, 1) nowait
    for (int64_t p = 0; p < (N + 31) / 32; p++) {
        __m512 acc[ROWS][2];
        float sums[32];
        for (int64_t r0 = 0; r0 < B; r0 += ROWS) {
            const int rows = B - r0 < ROWS ? (int)(B - r0) : ROWS;
            tile_pair(w, 2 * p, 2 * p + 1, K, r0, rows, xq, dx, sx, xsum, acc);
            for (int i = 0; i < rows; i++) {
                _mm512_storeu_ps(sums, acc[i][0]);
                _mm512_storeu_ps(sums + 16, acc[i][1]);
                for (int64_t j = 0; j < 32 && p * 32 + j < N; j++) {
                    const int64_t n = p * 32 + j;
                    const float v = bias ? in_dtype(sums[j], is_bf16) + load(bias, n, is_bf16) : sums[j];
                    store(out, (r0 + i) * N + n, v, is_bf16);
                }
            }
        }
    }
}

/* The MLP's gate-up product and SiLU-and-mul over block weights: gate tile t and up tile I/16 + t together, their
   16 outputs rounded to the dtype (the layer's output), then silu_mul_block. I % 16 == 0. No barrier. */
static void silu_mul_block(const float *g, const float *u, int64_t n, void *out, int64_t j0, int is_bf16);
static void block_gate_up(const void *x, const blocks_t *w, int64_t I, int64_t H, int64_t B, void *act,
                          int is_bf16) {
    const int64_t blocks = H / 32, es = is_bf16 ? 2 : 4;
    uint8_t xq[B * H];
    float dx[B * blocks], sx[B * blocks];
    int32_t xsum[B * blocks];
    quantize_rows(x, H, B, is_bf16, xq, dx, sx, xsum);
    #pragma omp for schedule(dynamic, 1) nowait
    for (int64_t t = 0; t < I / 16; t++) {
        __m512 acc[ROWS][2];
        float g[16], u[16];
        for (int64_t r0 = 0; r0 < B; r0 += ROWS) {
            const int rows = B - r0 < ROWS ? (int)(B - r0) : ROWS;
            tile_pair(w, t, I / 16 + t, H, r0, rows, xq, dx, sx, xsum, acc);
            for (int i = 0; i < rows; i++) {
                _mm512_storeu_ps(g, acc[i][0]);
                _mm512_storeu_ps(u, acc[i][1]);
                for (int j = 0; j < 16; j++) { g[j] = in_dtype(g[j], is_bf16); u[j] = in_dtype(u[j], is_bf16); }
                silu_mul_block(g, u, 16, (char *)act + (r0 + i) * I * es, t * 16, is_bf16);
            }
        }
    }
}
#else
static void block_matvec(const void *x, const blocks_t *w, const void *bias, int64_t N, int64_t K, int64_t B,
                         void *out, int is_bf16) {}
static void block_gate_up(const void *x, const blocks_t *w, int64_t I, int64_t H, int64_t B, void *act,
                          int is_bf16) {}
#endif
int has_blocks(void) { return HAS_BLOCKS; }
"""

BlockWeights = Union[PackedBlocks, PackedNibbles]  # one product's GGUF blocks, as ops/cpu_block_int8.py packs them


class Blocks(ctypes.Structure):
    """One product's GGUF block weights as the kernel takes them (blocks_t; ops/cpu_block_int8.py's `pack`)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("q", "scale", "offset", "start")] + \
        [("nibbles", ctypes.c_int64)]

    @classmethod
    def of(cls, packed: PackedBlocks | PackedNibbles) -> Blocks:
        if isinstance(packed, PackedNibbles):
            return cls(packed.weight.data_ptr(), packed.scale.data_ptr(),
                       None if packed.offset is None else packed.offset.data_ptr(), None, 1)
        return cls(packed.weight.data_ptr(), packed.scale.data_ptr(),
                   None if packed.offset is None else packed.offset.data_ptr(), packed.start.data_ptr(), 0)



def block_weight_tables(blocks: Sequence[Sequence[BlockWeights] | None] | None, num_layers: int, hidden: int,
                        q_width: int, qkv_rows: int) -> list[tuple[Any, Sequence[BlockWeights]] | None] | None:
    """Per layer, None or (the kernel's blocks_t[4], the four BlockWeights it points into: qkv, o, gate_up, down),
    after checking their shapes."""
    if blocks is None:
        return None
    if len(blocks) != num_layers:
        raise ValueError(f"decode_step: block weights for {len(blocks)} layers, the model has {num_layers}")
    tables: list[tuple[Any, Sequence[BlockWeights]] | None] = []
    for layer_blocks in blocks:
        if layer_blocks is None:
            tables.append(None)
            continue
        qkv, o, gate_up, down = layer_blocks
        intermediate = gate_up.n // 2
        shapes = [(qkv, qkv_rows, hidden), (o, hidden, q_width), (gate_up, 2 * intermediate, hidden),
                  (down, hidden, intermediate)]
        if any(packed.n != rows or packed.width != width for packed, rows, width in shapes) or intermediate % 16 \
                or max(hidden, q_width, intermediate) > MAX_BLOCK_WIDTH:
            raise ValueError(f"decode_step's block weights: qkv [{qkv_rows}, {hidden}], o [{hidden}, {q_width}], "
                             f"gate_up [2 I, {hidden}], down [{hidden}, I] with I a multiple of 16, inputs up to "
                             f"{MAX_BLOCK_WIDTH}; got {[(p.n, p.width) for p in layer_blocks]}")
        table = (Blocks * 4)(*[Blocks.of(p) for p in layer_blocks])
        tables.append((table, layer_blocks))
    return tables
