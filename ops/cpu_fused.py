"""Fused CPU kernels for the elementwise ops of a decoder layer: RMSNorm (with the residual addition),
SiLU-and-multiply, and the rotary embedding of query and key.

In torch each of these is a chain of ops (RMSNorm: add, to float, pow, mean, add, rsqrt, mul, to, mul;
rotary: four multiplies, two negations, two concatenations, two additions), each reading and writing
its whole tensor and each paying torch's per-op dispatch. Measured on the development machine (one
thread, W3's 2048-token prefill chunk, float32, per layer): add + RMSNorm 6.7 ms, rotary 9.2 ms,
SiLU-and-multiply 13.7 ms, about a third of the layer's matmul time; bfloat16 is no cheaper, as torch
widens to float32 and back between ops. Here each is one pass over its rows.

The arithmetic follows the torch references (`rms_norm_native`, `rotary_native`, `silu_and_mul_native`)
operation by operation, rounding where they round (bfloat16 results rounded to nearest-even after each
op torch runs in bfloat16, and no fused multiply-adds: the file is built with -ffp-contract=off). Two
things differ by rounding only: the order of the RMSNorm's sum of squares, and SiLU's exponential
(a degree-7 polynomial on AVX-512, about 1 ulp; glibc's expf elsewhere). The tests compare each kernel
with its reference (tests/ops/test_cpu_fused.py).

Built and loaded as ops/cpu_build.py says (the system C compiler, cached in ~/.cache/asyncengine/kernels,
ctypes), with the OpenMP runtime torch already loaded; `ASYNCENGINE_CPU_KERNELS=0` turns it off, and without a
compiler the layers keep their torch references.
"""

from __future__ import annotations

import ctypes

import torch

from asyncengine.ops.cpu_build import AVX512_BF16, AVX512_EXP, C_PRELUDE, KernelLibrary

C_SOURCE = C_PRELUDE + AVX512_EXP + r"""
#if defined(__AVX512F__)
#include <immintrin.h>
#endif


/* out[r] = weight * norm(s[r]), s = x (+ residual_in); residual_out[r] <- s when given. Rows of `width`;
   x, residual_in and out have row strides (elements), residual_out is contiguous. With `weight_f32` the
   weight is float32 whatever the dtype and multiplies the float32 norm before the one rounding (Gemma's
   `(norm(x) * (1 + w)).to(dtype)` and OLMo 2's `(w * norm(x)).to(dtype)`), not after it as Llama's does. */
int rms_norm(const void *x, int64_t x_stride, const void *residual_in, int64_t res_stride, void *residual_out,
             void *out, int64_t out_stride, const void *weight, int64_t rows, int64_t width, float eps,
             int is_bf16, int weight_f32, int threads) {
    int failed = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) if(rows * width >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        float sbuf[8192];
        float *s = sbuf;
        if (width > 8192) { failed = 1; continue; }
        float acc = 0.0f;
        for (int64_t i = 0; i < width; i++) {
            float v = load(x, r * x_stride + i, is_bf16);
            if (residual_in) v = in_dtype(v + load(residual_in, r * res_stride + i, is_bf16), is_bf16);
            s[i] = v;
        }
        #pragma omp simd reduction(+:acc)
        for (int64_t i = 0; i < width; i++) acc += s[i] * s[i];
        const float inv = 1.0f / sqrtf(acc / (float)width + eps);
        if (residual_out) for (int64_t i = 0; i < width; i++) store(residual_out, r * width + i, s[i], is_bf16);
        if (is_bf16 && weight_f32) {
            const float *w = (const float *)weight;
            for (int64_t i = 0; i < width; i++) store(out, r * out_stride + i, w[i] * (s[i] * inv), 1);
        } else if (is_bf16) {
            for (int64_t i = 0; i < width; i++)
                store(out, r * out_stride + i, load(weight, i, 1) * bf(to_bf(s[i] * inv)), 1);
        } else {
            const float *w = (const float *)weight;
            float *o = (float *)out + r * out_stride;
            #pragma omp simd
            for (int64_t i = 0; i < width; i++) o[i] = w[i] * (s[i] * inv);
        }
    }
    return failed ? -1 : 0;
}

#if defined(__AVX512F__)
/* exp16: ops/cpu_build.py's AVX512_EXP, included at the top. */

""" + AVX512_BF16 + r"""#endif

/* out[r, i] = silu(x[r, i]) * x[r, d + i]: rows of x are [gate | up], 2d wide, with a row stride. */
int silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t d, int is_bf16, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if(rows * d >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = 0;
#if defined(__AVX512F__)
        if (!is_bf16) {
            const float *g = (const float *)x + r * x_stride, *u = g + d;
            float *o = (float *)out + r * d;
            const __m512 one = _mm512_set1_ps(1.0f);
            for (; i + 16 <= d; i += 16) {
                const __m512 gv = _mm512_loadu_ps(g + i);
                const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
                const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
                _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
            }
        } else {
            const uint16_t *g = (const uint16_t *)x + r * x_stride, *u = g + d;
            uint16_t *o = (uint16_t *)out + r * d;
            const __m512 one = _mm512_set1_ps(1.0f);
            for (; i + 16 <= d; i += 16) {
                const __m512 gv = widen16(g + i);
                const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
                const __m512 silu = round16(_mm512_div_ps(gv, _mm512_add_ps(one, e)));  /* F.silu's bfloat16 result */
                _mm256_storeu_si256((__m256i *)(o + i), narrow16(_mm512_mul_ps(silu, widen16(u + i))));
            }
        }
#endif
        for (; i < d; i++) {
            const float g = load(x, r * x_stride + i, is_bf16), u = load(x, r * x_stride + d + i, is_bf16);
            const float s = in_dtype(g / (1.0f + expf(-g)), is_bf16);
            store(out, r * d + i, s * u, is_bf16);
        }
    }
    return 0;
}

/* The NeoX rotation of `heads` heads of width D per token, from src (token and head strides) into dst
   (contiguous [tokens, heads, D]): dst = src * cos + rotate_half(src) * sin, each product and the sum
   rounded to the dtype as torch's ops do. cos/sin: [tokens, D] contiguous. */
static void rotate(const void *src, int64_t tok_stride, int64_t head_stride, void *dst, int64_t heads, const void *cs,
                   const void *sn, int64_t tokens, int64_t D, int is_bf16, int threads) {
    const int64_t half = D / 2;
    #pragma omp parallel for num_threads(threads) schedule(static) if(tokens * heads * D >= 32768)
    for (int64_t n = 0; n < tokens; n++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t from = n * tok_stride + h * head_stride, to = (n * heads + h) * D;
            if (!is_bf16) {
                const float *v = (const float *)src + from;
                float *o = (float *)dst + to;
                const float *c = (const float *)cs + n * D, *s = (const float *)sn + n * D;
                #pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    const float a = v[i], b = v[i + half];
                    o[i] = a * c[i] + (-b) * s[i];
                    o[i + half] = b * c[i + half] + a * s[i + half];
                }
            } else {
                const uint16_t *v = (const uint16_t *)src + from;
                uint16_t *o = (uint16_t *)dst + to;
                const uint16_t *c = (const uint16_t *)cs + n * D, *s = (const uint16_t *)sn + n * D;
                int64_t i = 0;
#if defined(__AVX512F__)
                /* 16 at a time, each product and the sum rounded to bfloat16 where the scalar loop rounds */
                for (; i + 16 <= half; i += 16) {
                    const __m512 a = widen16(v + i), b = widen16(v + i + half);
                    const __m512 lo = _mm512_add_ps(round16(_mm512_mul_ps(a, widen16(c + i))),
                                                    round16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b),
                                                                          widen16(s + i))));
                    const __m512 hi = _mm512_add_ps(round16(_mm512_mul_ps(b, widen16(c + i + half))),
                                                    round16(_mm512_mul_ps(a, widen16(s + i + half))));
                    _mm256_storeu_si256((__m256i *)(o + i), narrow16(lo));
                    _mm256_storeu_si256((__m256i *)(o + i + half), narrow16(hi));
                }
#endif
                for (; i < half; i++) {
                    const float a = bf(v[i]), b = bf(v[i + half]);
                    o[i] = to_bf(bf(to_bf(a * bf(c[i]))) + bf(to_bf(-b * bf(s[i]))));
                    o[i + half] = to_bf(bf(to_bf(b * bf(c[i + half]))) + bf(to_bf(a * bf(s[i + half]))));
                }
            }
        }
    }
}

int rotary(const void *q, int64_t q_tok, int64_t q_head, int64_t q_heads, void *q_out, const void *k, int64_t k_tok,
           int64_t k_head, int64_t k_heads, void *k_out, const void *cs, const void *sn, int64_t tokens, int64_t D,
           int is_bf16, int threads) {
    rotate(q, q_tok, q_head, q_out, q_heads, cs, sn, tokens, D, is_bf16, threads);
    rotate(k, k_tok, k_head, k_out, k_heads, cs, sn, tokens, D, is_bf16, threads);
    return 0;
}
"""

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
MAX_NORM_WIDTH = 8192  # the kernel's per-row scratch
# -ffp-contract=off: no fused multiply-adds, so float32 results round where torch's separate ops do.
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"],
              ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"])


_P, _I = ctypes.c_void_p, ctypes.c_int64


def _declare(library: ctypes.CDLL) -> None:
    library.rms_norm.restype = library.silu_and_mul.restype = library.rotary.restype = ctypes.c_int
    library.rms_norm.argtypes = [_P, _I, _P, _I, _P, _P, _I, _P, _I, _I, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int]
    library.silu_and_mul.argtypes = [_P, _I, _P, _I, _I, ctypes.c_int, ctypes.c_int]
    library.rotary.argtypes = [_P, _I, _I, _I, _P, _P, _I, _I, _I, _P, _P, _P, _I, _I, ctypes.c_int, ctypes.c_int]


_kernels = KernelLibrary("cpu_fused", C_SOURCE, _FLAG_SETS, _declare, dtypes=SUPPORTED_DTYPES,
                         what="fused CPU kernels", fallback="norms, rotary and SiLU use their torch references")


def available(dtype: torch.dtype) -> bool:
    """Whether the compiled kernels run for tensors of `dtype` (compiling them on first use)."""
    return _kernels.available(dtype)


def unavailable_reason() -> str | None:
    return _kernels.unavailable_reason()


def _rows_view(t: torch.Tensor) -> int | None:
    """The row stride of `t` seen as `[rows, last dim]` (unit stride within a row), or None if it is not such."""
    if t.device.type != "cpu" or t.dim() < 1 or t.stride(-1) != 1:
        return None
    if t.dim() == 1:
        return t.shape[0]
    if t.dim() == 2:
        return t.stride(0)
    return t.shape[-1] if t.is_contiguous() else None


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None, *,
                       weight_f32: bool = False) -> bool:
    weight_dtype = torch.float32 if weight_f32 else x.dtype
    return (x.dtype in SUPPORTED_DTYPES and weight.dtype == weight_dtype and weight.is_contiguous()
            and x.shape[-1] == weight.shape[0] <= MAX_NORM_WIDTH and _rows_view(x) is not None
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape
                                      and _rows_view(residual) is not None))
            and available(x.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             weight_f32: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_native(x, weight, eps)`; given `residual`, `(norm(x + residual), x + residual)` as RMSNorm returns.
    `weight_f32`: a float32 weight applied before the rounding to x's dtype (norm.py's `rms_norm_float32_weight`)."""
    library = _kernels.get(x.dtype)
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    out = torch.empty(x.shape, dtype=x.dtype)
    summed = torch.empty(x.shape, dtype=x.dtype) if residual is not None else None
    status = library.rms_norm(
        x.data_ptr(), _rows_view(x), residual.data_ptr() if residual is not None else None,
        _rows_view(residual) if residual is not None else 0, summed.data_ptr() if summed is not None else None,
        out.data_ptr(), width, weight.data_ptr(), rows, width, eps, int(x.dtype == torch.bfloat16), int(weight_f32),
        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"rms_norm: rows of {width} are wider than the kernel's {MAX_NORM_WIDTH}")
    return out if summed is None else (out, summed)


def silu_and_mul_supported(x: torch.Tensor) -> bool:
    return x.dtype in SUPPORTED_DTYPES and x.shape[-1] % 2 == 0 and _rows_view(x) is not None \
        and available(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul_native(x)`: `[..., 2d]` -> `[..., d]`."""
    library = _kernels.get(x.dtype)
    d = x.shape[-1] // 2
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype)
    library.silu_and_mul(x.data_ptr(), _rows_view(x), out.data_ptr(), rows, d, int(x.dtype == torch.bfloat16),
                          torch.get_num_threads())
    return out


def _heads_layout(t: torch.Tensor) -> tuple[int, int] | None:
    """(token stride, head stride) of `[tokens, heads, head_dim]` with unit stride within a head."""
    if t.dim() != 3 or t.device.type != "cpu" or t.stride(2) != 1:
        return None
    return t.stride(0), t.stride(1)


def rotary_supported(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    tokens, _, dim = query.shape if query.dim() == 3 else (0, 0, 0)
    return (query.dtype in SUPPORTED_DTYPES and key.dtype == cos.dtype == sin.dtype == query.dtype
            and dim % 2 == 0 and _heads_layout(query) is not None and _heads_layout(key) is not None
            and key.shape[0] == tokens and key.shape[2] == dim
            and cos.shape == sin.shape == (tokens, 1, dim) and cos.is_contiguous() and sin.is_contiguous()
            and available(query.dtype))


def rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_native(query, key, cos, sin)`: new contiguous tensors (the inputs may be strided views)."""
    library = _kernels.get(query.dtype)
    (q_tok, q_head), (k_tok, k_head) = _heads_layout(query), _heads_layout(key)  # type: ignore[misc]
    q_out, k_out = torch.empty(query.shape, dtype=query.dtype), torch.empty(key.shape, dtype=key.dtype)
    library.rotary(query.data_ptr(), q_tok, q_head, query.shape[1], q_out.data_ptr(), key.data_ptr(), k_tok, k_head,
                    key.shape[1], k_out.data_ptr(), cos.data_ptr(), sin.data_ptr(), query.shape[0], query.shape[2],
                    int(query.dtype == torch.bfloat16), torch.get_num_threads())
    return q_out, k_out
