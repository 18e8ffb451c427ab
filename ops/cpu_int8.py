"""The per-call work around an int8 matmul with dynamically quantized activations, on CPU, in two passes.

`int8_dynamic` (asyncengine/models/layers/quantization.py) quantizes each row of a linear layer's input
to int8 with its own scale, multiplies on int8 (`torch._int_mm`), and scales the int32 sums back. In torch
that is about ten small ops per layer around the matmul (to float32, abs, amax, clamp, divide, round,
clamp, to int8; two multiplies and a cast after): at W3's decode batch they cost more than a quarter of
a float32 decode step, as much as the int8 matmuls saved. Here each side is one pass of a small C
kernel, rounding as the torch reference does:

- `quantize_rows(x)`: scale = max(|x| over the row, 1e-12) / 127 in float32; q = round-half-even(x /
  scale) clamped to [-127, 127]; bit-equal to `quantize_rows_int8`.
- `scale_rows(acc, x_scale, w_scale, dtype)`: float32(acc) * (x_scale[row] * w_scale[col]), rounded to
  `dtype`; bit-equal to the reference's `(acc * (x_scale * w_scale)).to(dtype)`.

Built and loaded as ops/cpu_build.py says; without a compiler the layer keeps the torch ops.
"""

from __future__ import annotations

import ctypes

import torch

from asyncengine.ops.cpu_build import C_PRELUDE, KernelLibrary

C_SOURCE = C_PRELUDE + r"""

/* max(a, b) that keeps a NaN in `a`, as torch's clamp does (fmaxf would drop it, and is a call per element). */
static inline float larger(float a, float b) { return (a > b || a != a) ? a : b; }

/* x: [rows, width] with row stride `stride` (float32 or bfloat16); q: [rows, width] int8; scale: [rows]. */
int quantize_rows(const void *x, int64_t stride, int64_t rows, int64_t width, int is_bf16, int8_t *q,
                  float *scale, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if(rows * width >= 262144)
    for (int64_t r = 0; r < rows; r++) {
        /* The row's largest magnitude, vectorized; a NaN anywhere makes it NaN (torch's amax), tracked apart
           because a vector max drops NaNs. */
        float amax = 0.0f;
        int nan = 0;
        if (is_bf16) {
            const uint16_t *row = (const uint16_t *)x + r * stride;
            #pragma omp simd reduction(max:amax) reduction(|:nan)
            for (int64_t i = 0; i < width; i++) {
                const float a = fabsf(bf(row[i]));
                amax = a > amax ? a : amax;
                nan |= a != a;
            }
        } else {
            const float *row = (const float *)x + r * stride;
            #pragma omp simd reduction(max:amax) reduction(|:nan)
            for (int64_t i = 0; i < width; i++) {
                const float a = fabsf(row[i]);
                amax = a > amax ? a : amax;
                nan |= a != a;
            }
        }
        if (nan) amax = NAN;
        const float s = larger(amax, 1e-12f) / 127.0f;
        scale[r] = s;
        int8_t *out = q + r * width;
        if (is_bf16) {
            const uint16_t *row = (const uint16_t *)x + r * stride;
            #pragma omp simd
            for (int64_t i = 0; i < width; i++) {
                float v = rintf(bf(row[i]) / s);
                out[i] = (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
            }
        } else {
            const float *row = (const float *)x + r * stride;
            #pragma omp simd
            for (int64_t i = 0; i < width; i++) {
                float v = rintf(row[i] / s);
                out[i] = (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
            }
        }
    }
    return 0;
}

/* out[r, c] = (float)acc[r, c] * (x_scale[r] * w_scale[c]), as float32 or rounded to bfloat16. */
int scale_rows(const int32_t *acc, int64_t rows, int64_t cols, const float *x_scale, const float *w_scale,
               void *out, int is_bf16, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if(rows * cols >= 262144)
    for (int64_t r = 0; r < rows; r++) {
        const float xs = x_scale[r];
        const int32_t *a = acc + r * cols;
        if (is_bf16) {
            uint16_t *o = (uint16_t *)out + r * cols;
            #pragma omp simd
            for (int64_t c = 0; c < cols; c++) o[c] = to_bf((float)a[c] * (xs * w_scale[c]));
        } else {
            float *o = (float *)out + r * cols;
            #pragma omp simd
            for (int64_t c = 0; c < cols; c++) o[c] = (float)a[c] * (xs * w_scale[c]);
        }
    }
    return 0;
}
"""

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# -ffp-contract=off: no fused multiply-adds, so float32 results round where torch's separate ops do.
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"],
              ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"])


_P, _I = ctypes.c_void_p, ctypes.c_int64


def _declare(library: ctypes.CDLL) -> None:
    library.quantize_rows.restype = library.scale_rows.restype = ctypes.c_int
    library.quantize_rows.argtypes = [_P, _I, _I, _I, ctypes.c_int, _P, _P, ctypes.c_int]
    library.scale_rows.argtypes = [_P, _I, _I, _P, _P, _P, ctypes.c_int, ctypes.c_int]


_kernels = KernelLibrary("cpu_int8", C_SOURCE, _FLAG_SETS, _declare, dtypes=SUPPORTED_DTYPES,
                         what="int8 CPU kernels", fallback="int8_dynamic quantizes and scales with torch ops")


def available(dtype: torch.dtype) -> bool:
    """Whether the compiled kernels run for tensors of `dtype` (compiling them on first use)."""
    return _kernels.available(dtype)


def unavailable_reason() -> str | None:
    return _kernels.unavailable_reason()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_int8(x)` for a 2-D CPU `x` with unit stride in a row: (int8 `[rows, width]`, float32
    scale `[rows, 1]`)."""
    if x.dim() != 2 or x.device.type != "cpu" or x.stride(1) != 1 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"quantize_rows takes a 2-D float32 or bfloat16 CPU tensor with unit stride in a row, "
                         f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    library = _kernels.get(x.dtype)
    rows, width = x.shape
    q = torch.empty((rows, width), dtype=torch.int8)
    scale = torch.empty((rows, 1), dtype=torch.float32)
    library.quantize_rows(x.data_ptr(), x.stride(0), rows, width, int(x.dtype == torch.bfloat16), q.data_ptr(),
                          scale.data_ptr(), torch.get_num_threads())
    return q, scale


def scale_rows(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`(acc * (x_scale * w_scale)).to(dtype)`: `acc` int32 `[rows, cols]`, `x_scale` float32 `[rows, 1]`,
    `w_scale` float32 `[cols]`, all contiguous on CPU."""
    rows, cols = acc.shape
    if (acc.dtype != torch.int32 or x_scale.dtype != torch.float32 or w_scale.dtype != torch.float32
            or not (acc.is_contiguous() and x_scale.is_contiguous() and w_scale.is_contiguous())
            or x_scale.numel() != rows or w_scale.numel() != cols or dtype not in SUPPORTED_DTYPES):
        raise ValueError(f"scale_rows takes contiguous int32 sums {tuple(acc.shape)}, float32 row scales "
                         f"{tuple(x_scale.shape)} and column scales {tuple(w_scale.shape)}, into float32 or bfloat16")
    library = _kernels.get(dtype)
    out = torch.empty((rows, cols), dtype=dtype)
    library.scale_rows(acc.data_ptr(), rows, cols, x_scale.data_ptr(), w_scale.data_ptr(), out.data_ptr(),
                       int(dtype == torch.bfloat16), torch.get_num_threads())
    return out
