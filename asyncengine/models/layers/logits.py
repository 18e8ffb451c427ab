"""What causal LMs do to the head's logits after the matrix product, in one place for native models and the
transformers backend: a multiplier (Cohere's logit_scale), a divisor (Granite's logits_scaling), a soft cap
(Gemma 2's final_logit_softcapping), in that order. Also how their load errors list names."""

from __future__ import annotations

import torch

from asyncengine.ops.paged_attention import soft_cap


def finish_logits(logits: torch.Tensor, *, multiplier: float | None = None, divisor: float | None = None,
                  cap: float | None = None) -> torch.Tensor:
    if multiplier is not None:
        logits = logits * multiplier
    if divisor is not None:
        logits = logits / divisor
    if cap is not None:
        logits = soft_cap(logits, cap)
    return logits


def some_names(names: list[str], limit: int = 8) -> str:
    """The first `limit` of `names`, sorted, and how many more (for errors about checkpoint tensors)."""
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
