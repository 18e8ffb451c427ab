"""Linear layers on CPU through oneDNN, with each weight reordered once, after loading, into the
blocked layout oneDNN's matmul reads (instead of F.linear re-reading the plain row-major weight).

Measured on the 2-core development machine (Xeon with AMX, one thread, the default model's four
layer shapes): a decode step's matmuls at 8-32 rows take 12-33% less time in float32 and 20-50% less
in bfloat16; a single row in float32 is faster through F.linear, so that case keeps it (see
`linear`). The reordered copy sits beside the layer's own weight, which stays what every other code
path reads (loading, tensor-parallel slices, introspection): float CPU linear weights take twice
their bytes.

Float32 and bfloat16 weights on CPU only, when torch was built with oneDNN; `ASYNCENGINE_CPU_KERNELS=0`
turns it off (as it does the C attention kernel), for A/B measurements.
"""

from __future__ import annotations

import logging
import os

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


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x W^T (+ b)`, through the reordered weight when there is one and it pays."""
    if packed is None or x.dim() != 2 or x.dtype != weight.dtype or (x.shape[0] == 1 and x.dtype == torch.float32):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
