"""Compiling and loading the CPU kernels' C sources (ops/cpu_attention.py, ops/cpu_fused.py, ops/cpu_int8.py).

Each source is compiled once per machine with the system C compiler (`cc`, or `CC`) into
~/.cache/asyncengine/kernels and loaded through ctypes, which releases the GIL during a call. The file
name holds a digest of the source, the compiler, its flags and the CPU's feature flags: `-march=native`
code built on one machine must never be loaded by another sharing the cache directory (an illegal
instruction kills the process). A kernel that cannot be built or loaded is not an error: the caller
keeps its torch reference, and `load_kernels` says why.

A build takes tens of seconds (a minute on a busy 2-core machine), so it never waits for a request: the
worker runs one small forward pass at start-up, which builds or loads every library the model's layers
use, with a progress line at INFO before and after each compile. Each build or load is noted in
`KERNEL_EVENTS` (what, how, how long), which the worker turns into start-up records.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DISABLE_VARIABLE = "ASYNCENGINE_CPU_KERNELS"

# C sources' shared start: the headers, bfloat16 <-> float32 (`to_bf` rounds to nearest-even as torch
# does, and keeps a NaN a NaN), and reading and writing elements of either dtype.
C_PRELUDE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t to_bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
/* A value as torch would hold it in the tensor's dtype: rounded to bfloat16 when the op runs in bfloat16; and
   element i of a float32 or bfloat16 array. */
static inline float in_dtype(float v, int is_bf16) { return is_bf16 ? bf(to_bf(v)) : v; }
static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void store(void *p, int64_t i, float v, int is_bf16) {
    if (is_bf16) ((uint16_t *)p)[i] = to_bf(v); else ((float *)p)[i] = v;
}
"""  # "0" keeps every layer on its torch reference


# exp(x) for AVX-512, 16 at a time (the softmax of ops/cpu_attention.py, SiLU in ops/cpu_fused.py): x = n ln2 + r,
# |r| <= ln2 / 2, e^r by Cephes' degree-7 polynomial (about 1 ulp), times 2^n by scalef (overflow to inf and
# underflow to 0 come out as expf's). gcc calls glibc's vector expf only under -ffast-math, and the scalar one
# was most of those kernels' arithmetic.
AVX512_EXP = r"""
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif
"""


# bfloat16 <-> float32 for AVX-512, 16 at a time (inside an `#if defined(__AVX512F__)` block, after
# <immintrin.h>): widen16 loads, narrow16 rounds to nearest-even as to_bf does, round16 rounds and widens back.
AVX512_BF16 = r"""/* bfloat16 <-> float32, 16 at a time; narrowing rounds to nearest-even as to_bf does (NaN stays NaN). */
static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m256i narrow16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(rounded);
}
static inline __m512 round16(__m512 v) {  /* v rounded to bfloat16, held as float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow16(v)), 16));
}
"""

@dataclass(frozen=True)
class KernelEvent:
    """One library made ready (or not) in this process."""

    name: str
    outcome: str  # "compiled", "cached" (loaded from an earlier build) or "unavailable"
    seconds: float
    detail: str  # the library's path, or why it is unavailable


# Every build or load in this process, in order; the worker reads what its warm-up added.
KERNEL_EVENTS: list[KernelEvent] = []


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "asyncengine" / "kernels"


def cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return os.uname().machine


def build_library(name: str, source: str, flag_sets: Sequence[Sequence[str]],
                  declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL:
    """The first of `flag_sets` that compiles and loads (a cached build when there is one), with its
    functions' signatures set by `declare`; RuntimeError listing what each attempt said otherwise."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    errors = []
    for flags in flag_sets:
        digest = hashlib.sha256((source + compiler + " ".join(flags) + cpu_signature()).encode()).hexdigest()[:16]
        target = cache_dir() / f"{name}-{digest}.so"
        started = time.monotonic()
        compiled = not target.exists()
        if compiled:
            logger.info("compiling the %s C kernels with %s (once per machine: cached in %s) ...", name,
                        os.path.basename(compiler), target.parent)
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                source_file = Path(scratch) / f"{name}.c"
                source_file.write_text(source)
                built = Path(scratch) / target.name
                result = subprocess.run([compiler, *flags, "-shared", "-fPIC", str(source_file), "-o", str(built),
                                         "-lm"], capture_output=True, text=True)
                if result.returncode != 0:
                    errors.append(f"{compiler} {' '.join(flags)}: {result.stderr.strip()[-400:]}")
                    continue
                os.replace(built, target)  # atomic: another process building the same file is harmless
        try:
            library = ctypes.CDLL(str(target))
        except OSError as exc:  # built for instructions this machine lacks, say
            errors.append(f"loading {target}: {exc}")
            continue
        declare(library)
        seconds = time.monotonic() - started
        if compiled:
            logger.info("compiled the %s C kernels in %.1f s", name, seconds)
        KERNEL_EVENTS.append(KernelEvent(name, "compiled" if compiled else "cached", seconds, str(target)))
        return library
    raise RuntimeError(f"compiling {name}.c failed: " + " | ".join(errors))


def load_kernels(name: str, source: str, flag_sets: Sequence[Sequence[str]],
                 declare: Callable[[ctypes.CDLL], None], *, fallback: str) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None), or (None, why not): off by ASYNCENGINE_CPU_KERNELS=0, or a failed build,
    which is logged once with what the layers do instead (`fallback`)."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        KERNEL_EVENTS.append(KernelEvent(name, "unavailable", 0.0, f"{DISABLE_VARIABLE}=0"))
        return None, f"{DISABLE_VARIABLE}=0"
    started = time.monotonic()
    try:
        return build_library(name, source, flag_sets, declare), None
    except (RuntimeError, OSError) as exc:
        logger.warning("%s kernels unavailable, %s: %s", name, fallback, exc)
        KERNEL_EVENTS.append(KernelEvent(name, "unavailable", time.monotonic() - started, str(exc)))
        return None, str(exc)


class KernelLibrary:
    """One C source's library, built and loaded on first use (`load_kernels`) for the dtypes it serves:
    `available(dtype)`, `unavailable_reason()`, and `get(dtype)`, the loaded library or a RuntimeError that
    says why there is none (`what` names the kernels in it)."""

    def __init__(self, name: str, source: str, flag_sets: Sequence[Sequence[str]],
                 declare: Callable[[ctypes.CDLL], None], *, dtypes: Sequence[object], what: str,
                 fallback: str) -> None:
        self.name, self.source, self.flag_sets, self.declare = name, source, flag_sets, declare
        self.dtypes, self.what, self.fallback = tuple(dtypes), what, fallback
        self.forget()

    def forget(self) -> None:
        """Back to not loaded: the next `available` builds or loads it again (tests use it)."""
        self.library: ctypes.CDLL | None = None
        self.reason: str | None = None  # why it is unavailable, once that is known

    def available(self, dtype: object) -> bool:
        if dtype not in self.dtypes:
            return False
        if self.library is None and self.reason is None:
            self.library, self.reason = load_kernels(self.name, self.source, self.flag_sets, self.declare,
                                                     fallback=self.fallback)
        return self.library is not None

    def unavailable_reason(self) -> str | None:
        return self.reason

    def get(self, dtype: object) -> ctypes.CDLL:
        if self.library is None:
            self.available(dtype)
        if self.library is None:
            raise RuntimeError(f"the {self.what} are unavailable: {self.reason}")
        return self.library
