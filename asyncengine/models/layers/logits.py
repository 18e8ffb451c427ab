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


class LogitsProcessor(torch.nn.Module):
    """vLLM's: `LogitsProcessor(vocab_size, org_vocab_size=None, scale=1.0, logits_as_input=False,
    soft_cap=None)`, called as `logits_processor(lm_head, hidden_states)` in a vLLM model's `compute_logits`: the
    head's logits (the full vocabulary, on every rank: models/layers/embedding.py), the first `org_vocab_size`
    columns, soft-capped then scaled, in vLLM's order."""

    def __init__(self, vocab_size: int, org_vocab_size: int | None = None, scale: float = 1.0,
                 logits_as_input: bool = False, soft_cap: float | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.org_vocab_size = org_vocab_size or vocab_size
        self.scale = scale
        self.logits_as_input = logits_as_input
        self.soft_cap = soft_cap

    def forward(self, lm_head: torch.nn.Module, hidden_states: torch.Tensor,
                embedding_bias: torch.Tensor | None = None) -> torch.Tensor:
        logits = hidden_states if self.logits_as_input else lm_head(hidden_states)
        if embedding_bias is not None:
            logits = logits + embedding_bias
        logits = logits[..., :self.org_vocab_size]
        if self.soft_cap is not None:
            logits = soft_cap(logits, self.soft_cap)
        return logits * self.scale if self.scale != 1.0 else logits
