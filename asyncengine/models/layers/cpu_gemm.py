"""Linear layers on CPU through oneDNN, with each weight reordered once, after loading, into the
blocked layout oneDNN's matmul reads (instead of F.linear re-reading the plain row-major weight).

Measured on the 2-core development machine (Xeon with AMX, one thread, the default model's four
layer shapes): a decode step's matmuls at 8-32 rows take 12-33% less time in float32 and 20-50% less
in bfloat16; a single row in float32 is faster through F.linear, so that case keeps it (see
`linear`). The reordered copy sits beside the layer's own weight, which stays what every other code
path reads (loading, tensor-parallel slices, introspection): float CPU linear weights take twice
their bytes.

Row counts in buckets (`rows_bucket`): oneDNN builds (JIT-compiles) and caches a primitive for each shape
it meets (ideep's and oneDNN's caches, 1024 entries each), and a step's row count is its number of tokens,
which varies with every mix of prompts and decodes. Unbucketed, each new count cost a compile (on this
machine the matmuls of 500 random counts at the model's shapes took 205 s, against 37 s bucketed) and about
0.6 MB per primitive, and the caches' churn left freed memory scattered: a soak's engine core grew by
hundreds of MB (issue 30, bench/RESULTS.md). Rows are padded up to one of eight sizes per power of two
(at most 12.5% more rows, about 90 sizes up to 8192), so the primitives are few, made once, and stay cached.

Float32 and bfloat16 weights on CPU only, when torch was built with oneDNN; `ASYNCENGINE_CPU_KERNELS=0`
turns it off (as it does the C attention kernel), for A/B measurements.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# The number of rows oneDNN is told to expect when reordering: the layout serves any row count.
ROWS_HINT = 32


def enabled() -> bool:
    return os.environ.get("ASYNCENGINE_CPU_KERNELS", "1") != "0" and torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight `[out, in]` reordered for oneDNN, or None where this path does not apply."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or not enabled():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
    except RuntimeError as exc:  # a torch whose oneDNN lacks this dtype on this CPU: F.linear serves
        logger.info("oneDNN cannot reorder a %s weight %s here (%s); that layer uses F.linear",
                    weight.dtype, tuple(weight.shape), exc)
        return None


def rows_bucket(rows: int) -> int:
    """`rows` rounded up to one of eight sizes per power of two (every size up to 16): 17 -> 18, 100 -> 104,
    1000 -> 1024."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)  # an eighth of the power of two at or below rows
    return -(-rows // step) * step


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x W^T (+ b)`, through the reordered weight when there is one and it pays; oneDNN's row counts
    bucketed (module docstring)."""
    if packed is None or x.dim() != 2 or x.dtype != weight.dtype or (x.shape[0] == 1 and x.dtype == torch.float32):
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2:
            return F.linear(x, weight, bias)  # (float32 F.linear is MKL's GEMM: no primitive per shape)
        return _bucketed(lambda padded: F.linear(padded, weight, bias), x)
    return _bucketed(lambda padded: torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], ""), x)


def _bucketed(matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    bucket = rows_bucket(rows)
    if bucket == rows:
        return matmul(x)
    return matmul(F.pad(x, (0, 0, 0, bucket - rows)))[:rows]
