"""LoRA-wrapped linear layers: `y = base(x) + scaling * (x A^T) B^T`, for each token with its own adapter.

Every wrapped layer holds `max_loras` slots of zero-padded matrices: `lora_a[slot]` is `[S * R, in]`
and `lora_b[slot]` `[S * R, out]`, where R is `max_lora_rank` and S the number of checkpoint
projections fused into the layer (3 for q/k/v, 2 for gate/up, else 1). Projection s of a fused layer
uses rows `s*R .. s*R + r` of both, and only its own output columns of `lora_b` (block-diagonal), so
one pair of matrix products serves all of them. The scaling is folded into `lora_b` when a slot is set.

One step's batch: `LoRAStep` says which slots are active (`slots`, k of them) and which of them each
token uses (`onehot`, `[tokens, k]`, a zero row for the base model). A layer then computes, for the
whole batch at once, `h = x @ A_active^T` (`[tokens, k*S*R]`), zeroes the columns of the adapters a
token does not use, and expands `h @ B_active`: two matrix products per layer whatever the mix of
adapters, never a pass per adapter. A step without adapters skips it all. On CUDA the same two steps are
the Triton kernels of ops/triton_lora.py (punica's shrink and expand), each token reading its own slot.

Tensor parallelism: a column-parallel layer keeps the rows of B its base layer keeps (its output
features), A whole; a row-parallel layer keeps the columns of A its base keeps (its input features), B
whole, and adds its delta to its partial sum before the all-reduce, which sums the deltas as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asyncengine.models.layers.linear import ColumnParallelLinear, RowParallelLinear


@dataclass
class LoRAStep:
    slots: torch.Tensor  # [k] slot indices of the adapters this step uses
    onehot: torch.Tensor  # [tokens, k], in the model's dtype: 1 where token t uses active adapter j
    token_slots: torch.Tensor  # [tokens] the slot of each token's adapter, -1 for the base model (the kernels')


class LoRAContext:
    """What every wrapped layer of one model reads: the current step's adapters (None: base model only)."""

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


class _LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, context: LoRAContext, *, projections: tuple[str, ...], in_features: int,
                 out_sizes: list[int], max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.context = context
        self.projections = projections  # the checkpoint projections fused here, in their output order
        self.max_rank = max_rank
        self.out_sizes = out_sizes  # this rank's output features of each projection
        width = len(projections) * max_rank
        self.lora_a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, width, sum(out_sizes), dtype=dtype, device=device)

    def add_delta(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`y` plus this step's LoRA contribution for `x`: on CUDA by the Triton shrink and expand kernels
        (ops/triton_lora.py, in place on `y`), elsewhere by the torch path below."""
        step = self.context.step
        if step is None:
            return y
        if x.is_cuda:
            from asyncengine.ops.triton_lora import lora_expand, lora_shrink

            shrunk = lora_shrink(x, self.lora_a, step.token_slots)
            return lora_expand(y.contiguous(), shrunk, self.lora_b, step.token_slots)
        return y + self._delta(x, step)

    def _delta(self, x: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        a = self.lora_a.index_select(0, step.slots)
        b = self.lora_b.index_select(0, step.slots)
        num_active, width, in_features = a.shape
        shrunk = x @ a.reshape(num_active * width, in_features).t()
        shrunk = (shrunk.view(-1, num_active, width) * step.onehot.unsqueeze(-1)).view(-1, num_active * width)
        return shrunk @ b.reshape(num_active * width, -1)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def set_projection(self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Projection `index` of this layer in `slot`: the whole checkpoint matrices A [r, in], B [out, r]."""
        rank = a.shape[0]
        rows = slice(index * self.max_rank, index * self.max_rank + rank)
        offset = sum(self.out_sizes[:index])
        columns = slice(offset, offset + self.out_sizes[index])
        self.lora_a[slot, rows] = self.local_a(a).to(self.lora_a.dtype)
        self.lora_b[slot, rows, columns] = (self.local_b(b, index) * scaling).t().to(self.lora_b.dtype)

    def local_a(self, a: torch.Tensor) -> torch.Tensor:
        return a

    def local_b(self, b: torch.Tensor, index: int) -> torch.Tensor:
        return b

    def expected_shapes(self, index: int) -> tuple[int, int]:
        """(in features, out features) of projection `index` in the checkpoint (before any rank's split)."""
        raise NotImplementedError


class ColumnParallelLoRA(_LoRALinear):
    base: ColumnParallelLinear

    def __init__(self, base: ColumnParallelLinear, context: LoRAContext, **options) -> None:
        if base.gather_output and base.tp_size > 1:
            raise ValueError(f"{base.prefix or 'ColumnParallelLinear'}: LoRA does not wrap a layer that gathers its "
                             "output")
        super().__init__(base, context, in_features=base.input_size, out_sizes=list(base.output_partition_sizes),
                         **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        base = self.base
        y = self.add_delta(base.quant_method.apply(base, x, None if base.skip_bias_add else base.bias), x)
        return base.layer_result(y)  # the base layer's form: (output, output_bias), or the output alone

    def local_b(self, b: torch.Tensor, index: int) -> torch.Tensor:
        start, end = self.base.shard_ranges[index]
        return b[start:end]

    def expected_shapes(self, index: int) -> tuple[int, int]:
        return self.base.input_size, self.base.output_sizes[index]


class RowParallelLoRA(_LoRALinear):
    base: RowParallelLinear

    def __init__(self, base: RowParallelLinear, context: LoRAContext, *, out_features: int, **options) -> None:
        start, end = base.input_range
        super().__init__(base, context, in_features=end - start, out_sizes=[out_features], **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        base = self.base
        if not base.input_is_parallel:
            start, end = base.input_range
            x = x[..., start:end]
        # The delta joins this rank's partial sum: the all-reduce sums the ranks' deltas with the base's.
        return base.layer_result(base.finish(self.add_delta(base.quant_method.apply(base, x), x)))

    def local_a(self, a: torch.Tensor) -> torch.Tensor:
        start, end = self.base.input_range
        return a[:, start:end]

    def expected_shapes(self, index: int) -> tuple[int, int]:
        return self.base.input_size, self.out_sizes[0]


__all__ = ["ColumnParallelLoRA", "LoRAContext", "LoRAStep", "RowParallelLoRA"]
