"""A linear layer over block-quantized int8 weights (GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) on CPU, with VNNI.

The weights keep a GGUF file's precision: every 32 consecutive inputs of an output row share a scale `d` and
an offset `o`, and each weight is `d * q + o` with a small signed integer `q` (Q4_1's `d * q4 + m` is
`d * (q4 - 8) + (m + 8 d)`; Q8_0 has no offset). At each call the activations are quantized the same way,
per block of 32 (`dx = max|x| / 127`, `xq = round(x / dx)`; llama.cpp's Q8_1), so that each block's dot
product runs on int8 with int32 sums (`vpdpbusd`, 64 multiply-adds an instruction) and is scaled once:

    y[m, n] = sum over blocks g of  dx[m, g] * d[n, g] * (xq[m, g] . q[n, g])  +  o[n, g] * sx[m, g]

where `sx[m, g] = dx[m, g] * sum(xq[m, g])`. This is exactly `dequantized x @ dequantized w.T`; the float32
sums are the only rounding (`reference_linear` computes it in float64). `vpdpbusd` multiplies unsigned by
signed bytes, so the activations go in as `xq + 128` and each block's sum starts at `-128 * sum(q)`.

Weights are packed once (`pack`) as `[N/16, K/4, 16, 4]` bytes: one 64-byte load holds 4 inputs of 16
outputs, next to which the activations' 4 bytes are broadcast. The kernel needs AVX-512 (F, BW) and VNNI; it
is built and loaded as ops/cpu_build.py says, and without it the layer dequantizes the weight on each call.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from asyncengine.ops.cpu_build import C_PRELUDE, KernelLibrary

BLOCK = 32
TILE = 16  # output rows per 512-bit vector of int32 sums
PAIR = 2 * TILE  # the kernel computes two tiles at once; N is padded to a multiple of it

# The block-int8 arithmetic both this module's layer kernel and the one-call decode step (ops/cpu_decode_step.py)
# run, so that the two compute the same values (inside an `#if` of AVX-512 F/BW/DQ and VNNI, after <immintrin.h>).
BLOCK_INT8_C = r"""
/* One block of 32 activations (float32 or bfloat16): dx = max|x| / 127, xq = round-half-even(x / dx) + 128 as
   bytes, sx = dx * sum(round(x / dx)). A block of zeros has dx 0; a block holding a NaN or an infinity gets dx
   NaN (its row's outputs are NaN). */
static inline void quantize_block32(const void *x, int is_bf16, uint8_t *out, float *dx, float *sx) {
    __m512 lo, hi;
    if (is_bf16) {
        const uint16_t *p = (const uint16_t *)x;
        lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
        hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 16))), 16));
    } else {
        const float *p = (const float *)x;
        lo = _mm512_loadu_ps(p);
        hi = _mm512_loadu_ps(p + 16);
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    /* A NaN is dropped by max: look for one (or an infinity) apart. */
    const __mmask16 bad = _mm512_fpclass_ps_mask(lo, 0x99) | _mm512_fpclass_ps_mask(hi, 0x99);
    const float d = amax / 127.0f;
    if (bad || d == 0.0f) {
        *dx = bad ? NAN : 0.0f; *sx = bad ? NAN : 0.0f;
        memset(out, 128, 32);
        return;
    }
    const __m512 vd = _mm512_set1_ps(d);
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512i qlo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(lo, vd), rnd));
    __m512i qhi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(hi, vd), rnd));
    const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
    qlo = _mm512_max_epi32(_mm512_min_epi32(qlo, lim), nlim);
    qhi = _mm512_max_epi32(_mm512_min_epi32(qhi, lim), nlim);
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    const __m512i bias = _mm512_set1_epi32(128);
    _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(_mm512_add_epi32(qlo, bias)));
    _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(qhi, bias)));
    *dx = d;
    *sx = d * (float)sum;
}

/* acc[r][t] += the block's offsets (o0, o1: its 16 outputs of each tile; NULL for none) times row r's sx. */
static inline __attribute__((always_inline)) void add_block_offsets(const int MR, const float *o0, const float *o1,
                                                                    const float *sx, int64_t blocks, int64_t g,
                                                                    __m512 acc[][2]) {
    if (!o0) return;
    const __m512 ov0 = _mm512_loadu_ps(o0 + g * 16), ov1 = _mm512_loadu_ps(o1 + g * 16);
    for (int r = 0; r < MR; r++) {
        const __m512 ss = _mm512_set1_ps(sx[r * blocks + g]);
        acc[r][0] = _mm512_fmadd_ps(ov0, ss, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(ov1, ss, acc[r][1]);
    }
}

/* MR rows of activations times one pair of 16-output tiles (32 outputs), over all K; out[r][0..31]. */
static inline __attribute__((always_inline)) void pair_rows(
        const int MR, const int8_t *w0, const int8_t *w1, const float *d0, const float *d1, const float *o0,
        const float *o1, const int32_t *b0, const int32_t *b1, const uint8_t *xq, int64_t width, const float *dx,
        const float *sx, int64_t blocks, __m512 acc[][2]) {
    for (int r = 0; r < MR; r++) { acc[r][0] = _mm512_setzero_ps(); acc[r][1] = _mm512_setzero_ps(); }
    for (int64_t g = 0; g < blocks; g++) {
        const __m512i start0 = _mm512_loadu_si512(b0 + g * 16), start1 = _mm512_loadu_si512(b1 + g * 16);
        __m512i s[6][2];
        for (int r = 0; r < MR; r++) { s[r][0] = start0; s[r][1] = start1; }
        const int8_t *wg0 = w0 + g * 32 * 16, *wg1 = w1 + g * 32 * 16;
        for (int k4 = 0; k4 < 8; k4++) {
            const __m512i v0 = _mm512_loadu_si512(wg0 + k4 * 64), v1 = _mm512_loadu_si512(wg1 + k4 * 64);
            for (int r = 0; r < MR; r++) {
                int32_t four;
                memcpy(&four, xq + r * width + g * 32 + k4 * 4, 4);
                const __m512i xb = _mm512_set1_epi32(four);
                s[r][0] = _mm512_dpbusd_epi32(s[r][0], xb, v0);
                s[r][1] = _mm512_dpbusd_epi32(s[r][1], xb, v1);
            }
        }
        const __m512 dv0 = _mm512_loadu_ps(d0 + g * 16), dv1 = _mm512_loadu_ps(d1 + g * 16);
        for (int r = 0; r < MR; r++) {
            const __m512 xs = _mm512_set1_ps(dx[r * blocks + g]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]), _mm512_mul_ps(dv0, xs), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]), _mm512_mul_ps(dv1, xs), acc[r][1]);
        }
        add_block_offsets(MR, o0, o1, sx, blocks, g, acc);
    }
}

#define ROWS 6
/* pair_rows for any 1 to ROWS rows, each count its own unrolled kernel. */
static inline void pair_any_rows(int rows, const int8_t *w0, const int8_t *w1, const float *d0, const float *d1,
                                 const float *o0, const float *o1, const int32_t *b0, const int32_t *b1,
                                 const uint8_t *xq, int64_t width, const float *dx, const float *sx, int64_t blocks,
                                 __m512 acc[][2]) {
    switch (rows) {
        case 1: pair_rows(1, w0, w1, d0, d1, o0, o1, b0, b1, xq, width, dx, sx, blocks, acc); break;
        case 2: pair_rows(2, w0, w1, d0, d1, o0, o1, b0, b1, xq, width, dx, sx, blocks, acc); break;
        case 3: pair_rows(3, w0, w1, d0, d1, o0, o1, b0, b1, xq, width, dx, sx, blocks, acc); break;
        case 4: pair_rows(4, w0, w1, d0, d1, o0, o1, b0, b1, xq, width, dx, sx, blocks, acc); break;
        case 5: pair_rows(5, w0, w1, d0, d1, o0, o1, b0, b1, xq, width, dx, sx, blocks, acc); break;
        case 6: pair_rows(6, w0, w1, d0, d1, o0, o1, b0, b1, xq, width, dx, sx, blocks, acc); break;
        default: break;
    }
}
"""

C_SOURCE = C_PRELUDE + r"""
#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
""" + BLOCK_INT8_C + r"""
int has_kernel(void) { return 1; }

/* Each row of x [rows, width] (row stride `stride`, float32 or bfloat16) per block of 32 (quantize_block32, in
   BLOCK_INT8_C). */
int quantize_blocks(const void *x, int64_t stride, int64_t rows, int64_t width, int is_bf16, uint8_t *xq,
                    float *dx, float *sx, int threads) {
    const int64_t blocks = width / 32;
    #pragma omp parallel for num_threads(threads) schedule(static) if(rows * width >= 65536)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < blocks; g++)
            quantize_block32(is_bf16 ? (const void *)((const uint16_t *)x + r * stride + g * 32)
                                     : (const void *)((const float *)x + r * stride + g * 32),
                             is_bf16, xq + r * width + g * 32, dx + r * blocks + g, sx + r * blocks + g);
    return 0;
}

static inline void store_row(__m512 a0, __m512 a1, void *out, int64_t col, int64_t n, int is_bf16) {
    const int64_t left = n - col;
    const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << (left > 0 ? left : 0)) - 1);
    const __mmask16 m1 = left >= 32 ? 0xffff : (__mmask16)((1u << (left > 16 ? left - 16 : 0)) - 1);
    if (is_bf16) {
        uint16_t *o = (uint16_t *)out + col;
#if defined(__AVX512BF16__)
        /* vcvtneps2bf16 rounds to nearest-even and keeps a NaN a NaN, as to_bf does. */
        _mm256_mask_storeu_epi16(o, m0, (__m256i)_mm512_cvtneps_pbh(a0));
        _mm256_mask_storeu_epi16(o + 16, m1, (__m256i)_mm512_cvtneps_pbh(a1));
#else
        float tmp[32];
        _mm512_storeu_ps(tmp, a0); _mm512_storeu_ps(tmp + 16, a1);
        for (int i = 0; i < 32 && i < left; i++) o[i] = to_bf(tmp[i]);
#endif
    } else {
        float *o = (float *)out + col;
        _mm512_mask_storeu_ps(o, m0, a0);
        _mm512_mask_storeu_ps(o + 16, m1, a1);
    }
}

/* out [rows, n] (row stride ldo, float32 or bfloat16) = the block-quantized product; the weights packed as
   ops/cpu_block_int8.py's `pack` lays them out, n padded to `padded` (a multiple of 32). */
int block_linear(const int8_t *w, const float *wd, const float *wo, const int32_t *wstart, int64_t n,
                 int64_t padded, int64_t width, const uint8_t *xq, const float *dx, const float *sx, int64_t rows,
                 void *out, int64_t ldo, int is_bf16, int threads) {
    const int64_t blocks = width / 32, pairs = padded / 32;
    const size_t elt = is_bf16 ? 2 : 4;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t t0 = 2 * p, t1 = 2 * p + 1;
        const int8_t *w0 = w + t0 * width * 16, *w1 = w + t1 * width * 16;
        const float *d0 = wd + t0 * blocks * 16, *d1 = wd + t1 * blocks * 16;
        const float *o0 = wo ? wo + t0 * blocks * 16 : 0, *o1 = wo ? wo + t1 * blocks * 16 : 0;
        const int32_t *b0 = wstart + t0 * blocks * 16, *b1 = wstart + t1 * blocks * 16;
        __m512 acc[ROWS][2];
        int64_t r = 0;
        for (; r + ROWS <= rows; r += ROWS) {
            pair_rows(ROWS, w0, w1, d0, d1, o0, o1, b0, b1, xq + r * width, width, dx + r * blocks,
                      sx + r * blocks, blocks, acc);
            for (int i = 0; i < ROWS; i++)
                store_row(acc[i][0], acc[i][1], (char *)out + (r + i) * ldo * elt, p * 32, n, is_bf16);
        }
        const int left = (int)(rows - r);  /* 0 to ROWS - 1 */
        pair_any_rows(left, w0, w1, d0, d1, o0, o1, b0, b1, xq + r * width, width, dx + r * blocks, sx + r * blocks,
                      blocks, acc);
        for (int i = 0; i < left; i++)
            store_row(acc[i][0], acc[i][1], (char *)out + (r + i) * ldo * elt, p * 32, n, is_bf16);
    }
    return 0;
}
#else
int has_kernel(void) { return 0; }
int quantize_blocks(const void *x, int64_t stride, int64_t rows, int64_t width, int is_bf16, uint8_t *xq,
                    float *dx, float *sx, int threads) { return -1; }
int block_linear(const int8_t *w, const float *wd, const float *wo, const int32_t *wstart, int64_t n,
                 int64_t padded, int64_t width, const uint8_t *xq, const float *dx, const float *sx, int64_t rows,
                 void *out, int64_t ldo, int is_bf16, int threads) { return -1; }
#endif
"""

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],)

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _declare(library: ctypes.CDLL) -> None:
    library.has_kernel.restype = library.quantize_blocks.restype = library.block_linear.restype = _C
    library.has_kernel.argtypes = []
    library.quantize_blocks.argtypes = [_P, _I, _I, _I, _C, _P, _P, _P, _C]
    library.block_linear.argtypes = [_P, _P, _P, _P, _I, _I, _I, _P, _P, _P, _I, _P, _I, _C, _C]
    if library.has_kernel() != 1:
        raise RuntimeError("this CPU lacks AVX-512 VNNI (the compiler built the kernel out)")


_kernels = KernelLibrary("cpu_block_int8", C_SOURCE, _FLAG_SETS, _declare, dtypes=SUPPORTED_DTYPES,
                         what="block-quantized int8 CPU kernels",
                         fallback="the gguf layers dequantize their weights on each call")


def available(dtype: torch.dtype) -> bool:
    """Whether the compiled kernel runs for activations of `dtype` (compiling it on first use)."""
    return _kernels.available(dtype)


def unavailable_reason() -> str | None:
    return _kernels.unavailable_reason()


@dataclass(frozen=True)
class PackedBlocks:
    """A weight laid out for `block_linear`: `n` outputs (padded to `padded`), `width` inputs."""

    weight: torch.Tensor  # int8 [padded / 16, width / 4, 16, 4]
    scale: torch.Tensor  # float32 [padded / 16, width / 32, 16]
    offset: torch.Tensor | None  # float32, as scale; None when every offset is 0 (Q8_0, Q4_0, Q5_0)
    start: torch.Tensor  # int32, as scale: -128 * the block's sum of q
    n: int
    padded: int
    width: int


@dataclass(frozen=True)
class PackedNibbles:
    """A weight whose integers all lie in -8..7 (Q4_0, Q4_1 and the like), at 4 bits, as ops/cpu_decode_step.py's
    products take it: tile by tile as `pack` lays them out, each byte q + 8 of input k (low nibble) and of
    input k + 4 (high) for 8 inputs of 16 outputs a 64-byte row; the scales and offsets PackedBlocks' own."""

    weight: torch.Tensor  # uint8 [padded / 16, width / 8, 16, 4]
    scale: torch.Tensor  # float32 [padded / 16, width / 32, 16], as PackedBlocks.scale
    offset: torch.Tensor | None  # as PackedBlocks.offset
    n: int
    padded: int
    width: int


def pack_nibbles(packed: PackedBlocks) -> PackedNibbles | None:
    """`packed` at 4 bits, or None when an integer lies outside -8..7."""
    q = packed.weight
    if int(q.min()) < -8 or int(q.max()) > 7:
        return None
    tiles = packed.padded // TILE
    pairs = (q.reshape(tiles, packed.width // 8, 2, TILE, 4).to(torch.int16) + 8).to(torch.uint8)
    nibbles = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
    return PackedNibbles(nibbles.contiguous(), packed.scale, packed.offset, packed.n, packed.padded, packed.width)


def check_blocks(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> None:
    n, width = q.shape
    if q.dtype != torch.int8 or width % BLOCK:
        raise ValueError(f"block-quantized weights are int8 with a multiple of {BLOCK} columns, got {q.dtype} "
                         f"{tuple(q.shape)}")
    for name, t in (("scale", scale), ("offset", offset)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (n, width // BLOCK)):
            raise ValueError(f"the block {name}s are float32 [{n}, {width // BLOCK}], got {t.dtype} {tuple(t.shape)}")


def pack(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> PackedBlocks:
    """Lay out `q` (int8 `[n, width]`), `scale` and `offset` (float32 `[n, width / 32]`) for the kernel."""
    check_blocks(q, scale, offset)
    n, width = q.shape
    padded = -(-n // PAIR) * PAIR
    blocks = width // BLOCK

    def rows_padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((padded - n, t.shape[1]))]) if padded > n else t

    tiles = padded // TILE
    weight = rows_padded(q).reshape(tiles, TILE, width // 4, 4).permute(0, 2, 1, 3).contiguous()

    def per_tile(t: torch.Tensor) -> torch.Tensor:  # [padded, blocks] -> [tiles, blocks, 16]
        return rows_padded(t).reshape(tiles, TILE, blocks).permute(0, 2, 1).contiguous()

    sums = q.reshape(n, blocks, BLOCK).to(torch.int32).sum(dim=2)
    has_offset = offset is not None and bool(offset.ne(0).any())
    return PackedBlocks(weight, per_tile(scale), per_tile(offset) if has_offset and offset is not None else None,
                        per_tile(sums * -128).to(torch.int32), n, padded, width)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x` (2-D, float32 or bfloat16, unit stride in a row) per block of 32: (`xq + 128` as uint8, dx, sx)."""
    if (x.dim() != 2 or x.device.type != "cpu" or x.stride(1) != 1 or x.dtype not in SUPPORTED_DTYPES
            or x.shape[1] % BLOCK):
        raise ValueError(f"quantize_activations takes a 2-D float32 or bfloat16 CPU tensor of whole blocks of "
                         f"{BLOCK} columns with unit stride in a row, got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    rows, width = x.shape
    library = _kernels.get(x.dtype)
    xq = torch.empty((rows, width), dtype=torch.uint8)
    dx = torch.empty((rows, width // BLOCK), dtype=torch.float32)
    sx = torch.empty((rows, width // BLOCK), dtype=torch.float32)
    library.quantize_blocks(x.data_ptr(), x.stride(0), rows, width, int(x.dtype == torch.bfloat16), xq.data_ptr(),
                            dx.data_ptr(), sx.data_ptr(), torch.get_num_threads())
    return xq, dx, sx


def linear(x: torch.Tensor, packed: PackedBlocks) -> torch.Tensor:
    """`x @ w.T` for `x` `[rows, width]` on CPU (float32 or bfloat16; the result in its dtype)."""
    if (x.dim() != 2 or x.device.type != "cpu" or x.stride(1) != 1 or x.dtype not in SUPPORTED_DTYPES
            or x.shape[1] != packed.width):
        raise ValueError(f"block_int8 linear takes a 2-D float32 or bfloat16 CPU tensor of {packed.width} "
                         f"columns with unit stride in a row, got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    library = _kernels.get(x.dtype)
    rows = x.shape[0]
    out = torch.empty((rows, packed.n), dtype=x.dtype)
    if rows == 0:
        return out
    xq, dx, sx = quantize_activations(x)
    offset = packed.offset.data_ptr() if packed.offset is not None else None
    library.block_linear(packed.weight.data_ptr(), packed.scale.data_ptr(), offset, packed.start.data_ptr(),
                         packed.n, packed.padded, packed.width, xq.data_ptr(), dx.data_ptr(), sx.data_ptr(), rows,
                         out.data_ptr(), packed.n, int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out


# -- the torch references ---------------------------------------------------------------------------------


def dequantize(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight `d * q + o` per block, in float32 (exact for GGUF's blocks), then `dtype`."""
    n, width = q.shape
    w = q.reshape(n, width // BLOCK, BLOCK).to(torch.float32) * scale[:, :, None]
    if offset is not None:
        w = w + offset[:, :, None]
    return w.reshape(n, width).to(dtype)


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What `quantize_activations` computes, in torch: (round(x / dx) as int32, dx) per block of 32."""
    rows, width = x.shape
    blocks = x.to(torch.float32).reshape(rows, width // BLOCK, BLOCK)
    dx = blocks.abs().amax(dim=2) / 127.0
    bad = ~torch.isfinite(blocks).all(dim=2)
    safe = torch.where(dx > 0, dx, torch.ones_like(dx))
    xq = torch.round(blocks / safe[:, :, None]).clamp_(-127, 127)
    xq = torch.where((dx > 0)[:, :, None] & ~bad[:, :, None], xq, torch.zeros_like(xq)).to(torch.int32)
    return xq.reshape(rows, width), torch.where(bad, torch.full_like(dx, float("nan")), dx)


def reference_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """`linear`'s product in float64: the activations quantized per block as the kernel does, times the
    dequantized weight (the kernel's only other rounding is its float32 sums)."""
    rows, width = x.shape
    xq, dx = quantize_activations_reference(x)
    x_dequantized = (xq.reshape(rows, width // BLOCK, BLOCK).to(torch.float64) * dx.to(torch.float64)[:, :, None])
    w = q.reshape(q.shape[0], width // BLOCK, BLOCK).to(torch.float64) * scale.to(torch.float64)[:, :, None]
    if offset is not None:
        w = w + offset.to(torch.float64)[:, :, None]
    return x_dequantized.reshape(rows, width) @ w.reshape(q.shape[0], width).t()
