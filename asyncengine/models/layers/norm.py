"""RMSNorm, with the residual addition fused in (as the decoder layers use it)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 whatever the model dtype, then scale in the model dtype, as
        # transformers does: parity depends on rounding at the same places.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`; or, given the running residual, `(norm(x + residual), x + residual)`."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
