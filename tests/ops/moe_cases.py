"""Random mixture-of-experts problems for the fused_moe checks (test_fused_moe.py, triton_moe_checks.py), seeded.

Each case draws the shapes, top-k (1-8), routing, activation, biases, and sometimes a slice of the model's
experts held here (`first_expert` > 0, as a rank under expert parallelism holds them), so that the set covers
tokens that pick no held expert, experts that get no token, and M = 1. `coverage` says which of those a set
of cases reached, so a test can prove it checked them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from asyncengine.ops.fused_moe import MoeConfig, select_experts

# The tolerance every implementation is held to against fused_moe_reference, as a fraction of the largest
# |reference| of the case (docs/custom_ops.md states it): float32 results differ by the order of float32 sums
# only; bfloat16 ones also by where an intermediate (an expert's gate-up or down output, the activation) rounds
# to a neighbouring bfloat16 when the sums ran in another order, which the next GEMM carries on.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclass
class Case:
    name: str
    hidden: torch.Tensor
    router_logits: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    config: MoeConfig

    @property
    def args(self) -> tuple:
        return (self.hidden, self.router_logits, self.w13, self.w2, self.w13_bias, self.w2_bias, self.config)


def make_case(seed: int, dtype: torch.dtype, *, tokens: int | None = None, device: str = "cpu",
              sizes: tuple[int, ...] = (32, 64, 96), inners: tuple[int, ...] = (32, 64)) -> Case:
    draw = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    held = draw.randint(2, 12)
    first = draw.choice([0, 0, draw.randint(1, 6)])  # a third of the cases hold a slice of the experts
    total = first + held + (draw.randint(1, 6) if first else 0)
    top_k = draw.randint(1, min(8, total))
    m = tokens if tokens is not None else draw.choice([1, draw.randint(2, 40)])
    size, inner = draw.choice(sizes), draw.choice(inners)
    routing = draw.choice(["softmax_topk", "topk_softmax"])
    config = MoeConfig(top_k=top_k, renormalize=draw.random() < 0.5, routing=routing,
                       activation=draw.choice(["silu", "silu", "swigluoai"]), first_expert=first)
    bias = draw.random() < 0.3

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)

    # Weights scaled so that each layer's outputs are of order one.
    return Case(
        name=(f"seed{seed} {str(dtype).split('.')[-1]} M={m} H={size} I={inner} experts {first}..{first + held - 1} "
              f"of {total} top{top_k} {routing} renorm={config.renormalize} {config.activation} bias={bias}"),
        hidden=randn(m, size), router_logits=randn(m, total).float(),
        w13=randn(held, 2 * inner, size, scale=size ** -0.5), w2=randn(held, size, inner, scale=inner ** -0.5),
        w13_bias=randn(held, 2 * inner, scale=0.1) if bias else None,
        w2_bias=randn(held, size, scale=0.1) if bias else None, config=config)


def as_rows_of_their_experts(case: Case, seed: int) -> Case:
    """What one rank runs under expert parallelism (asyncengine/models/layers/expert_parallel.py): each of the
    case's rows sent to it for one of its experts, drawn at random, named by router logits that choose that expert
    alone with weight 1 (top-1)."""
    from asyncengine.models.layers.expert_parallel import chosen_expert_logits, single_expert_config

    generator = torch.Generator().manual_seed(seed)
    first, held = case.config.first_expert, case.w13.shape[0]
    ids = first + torch.randint(0, held, (case.hidden.shape[0],), generator=generator)
    logits = chosen_expert_logits(ids.to(case.hidden.device), case.router_logits.shape[1], case.hidden.dtype)
    return Case(f"{case.name}, as rows of their experts", case.hidden, logits, case.w13, case.w2, case.w13_bias,
                case.w2_bias, single_expert_config(case.config))


def coverage(cases: list[Case]) -> set[str]:
    """What the cases reached: "expert without tokens", "token without held experts", "M=1", "top1", "top8"."""
    reached = set()
    for case in cases:
        _, ids = select_experts(case.router_logits, case.config)
        local = ids.cpu() - case.config.first_expert
        held = (local >= 0) & (local < case.w13.shape[0])
        if not held.any(dim=1).all():
            reached.add("token without held experts")
        if len(set(local[held].tolist())) < case.w13.shape[0]:
            reached.add("expert without tokens")
        if case.hidden.shape[0] == 1:
            reached.add("M=1")
        reached.add(f"top{case.config.top_k}")
    return reached


def max_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, the allowed error for this case: TOLERANCE times max |want|, at least the tolerance)."""
    error = float((got.float().cpu() - want.float().cpu()).abs().max()) if want.numel() else 0.0
    scale = max(1.0, float(want.float().abs().max())) if want.numel() else 1.0
    return error, TOLERANCE[want.dtype] * scale
