"""The mixture-of-experts op on CPU: tokens grouped per expert, each expert's two GEMMs run once on its group.

`fused_moe_cpu(hidden, router_logits, experts, config)` computes what `fused_moe_reference` (ops/fused_moe.py)
does, with the same routing (`select_experts`). Where the reference, per expert, compares every routing slot with the
expert's id, gathers its tokens, runs a chain of ops and adds the result into the output (a dozen torch ops
and a host synchronisation per expert, for every expert of the layer), here:

1. the (token, slot) pairs are sorted by expert once (`argsort`, `bincount`: one host read of the counts);
2. the tokens' rows are gathered in that order once (`index_select`);
3. each expert that has tokens runs gate-up, activation, down on its contiguous slice: three calls;
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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncengine.ops import cpu_block_int8, cpu_fused
from asyncengine.ops.cpu_build import C_PRELUDE, KernelLibrary
from asyncengine.ops.fused_moe import MoeConfig, activate, check_arguments, select_experts

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# The rows oneDNN is told to expect when reordering a weight: the layout serves any row count.
ROWS_HINT = 32

C_SOURCE = C_PRELUDE + r"""
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
"""

# -ffp-contract=off: each product is rounded before it is added, as torch's multiply then add do.
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"],
              ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"])
_P, _I = ctypes.c_void_p, ctypes.c_int64


def _declare(library: ctypes.CDLL) -> None:
    library.moe_combine.restype = ctypes.c_int
    library.moe_combine.argtypes = [_P, _I, _I, _I, _P, _P, _P, _P, _P, _I, ctypes.c_int, ctypes.c_int]


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

    @classmethod
    def pack(cls, w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None = None,
             w2_bias: torch.Tensor | None = None) -> DenseExperts:
        """With each expert's matrices reordered for oneDNN (once: keep the result while the weights stay)."""
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


def fused_moe_cpu(hidden: torch.Tensor, router_logits: torch.Tensor, experts: Experts,
                  config: MoeConfig) -> torch.Tensor:
    """`fused_moe_reference` with the tokens grouped per expert (see the module's docstring)."""
    if isinstance(experts, DenseExperts):
        check_arguments(hidden, router_logits, experts.w13, experts.w2, experts.w13_bias, experts.w2_bias, config)
    tokens, width = hidden.shape
    if tokens == 0:
        return torch.empty((0, width), dtype=hidden.dtype)
    num_experts = experts.num_experts
    weights, ids = select_experts(router_logits, config)
    k = ids.shape[1]
    # Local expert ids, and `num_experts` for a pair whose expert another rank holds (sorted last, never run).
    local = (ids - config.first_expert).reshape(-1)
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=num_experts + 1).tolist()
    held = len(order) - counts[num_experts]
    x = hidden.index_select(0, order[:held] // k)  # the pairs' rows, grouped by expert

    starts, bases, outputs = [0] * num_experts, [0] * num_experts, []
    start = 0
    for expert in range(num_experts):
        count = counts[expert]
        if count:
            y = experts.down(expert, _activate(experts.gate_up(expert, x[start:start + count]), config))
            if y.dtype != hidden.dtype or not y.is_contiguous():
                y = y.to(hidden.dtype).contiguous()
            starts[expert], bases[expert] = start, y.data_ptr()
            outputs.append((expert, start, y))  # kept alive until the combine has read it
        start += count

    position = torch.empty_like(order)
    position[order] = torch.arange(len(order))
    if not available(hidden.dtype):
        return _combine_with_torch(outputs, order, weights, tokens, k, width, hidden.dtype)
    out = torch.empty((tokens, width), dtype=hidden.dtype)
    weights = weights.reshape(-1).contiguous()
    _kernels.get(hidden.dtype).moe_combine(
        out.data_ptr(), tokens, width, k, local.data_ptr(), position.data_ptr(), weights.data_ptr(),
        (ctypes.c_int64 * num_experts)(*starts), (ctypes.c_int64 * num_experts)(*bases), num_experts,
        int(hidden.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def _combine_with_torch(outputs: list[tuple[int, int, torch.Tensor]], order: torch.Tensor, weights: torch.Tensor,
                        tokens: int, k: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """What `moe_combine` computes, where it is not built: per token, its k weighted outputs summed in float32."""
    pairs = torch.zeros((tokens * k, width), dtype=torch.float32)
    flat_weights = weights.reshape(-1)
    for _expert, start, y in outputs:
        rows = order[start:start + y.shape[0]]
        pairs[rows] = y.float() * flat_weights[rows, None]
    return pairs.view(tokens, k, width).sum(dim=1).to(dtype)
