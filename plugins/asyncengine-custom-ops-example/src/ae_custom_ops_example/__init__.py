"""An out-of-tree RMSNorm and an op provider for "silu_and_mul", registered by a general plugin.

- `ExampleRMSNorm` replaces the in-tree op named "RMSNorm": every `RMSNorm(hidden_size, eps,
  dtype=...)` the models build becomes an `ExampleRMSNorm`. It computes what the in-tree one does,
  to the bit (statistics in float32, scaled in the model dtype), so greedy outputs do not change.
- `silu_and_mul_inplace` is provider `ae_example` of op "silu_and_mul": it multiplies into the SiLU
  output instead of allocating a third tensor; `supports_silu_and_mul` accepts only the inputs it
  handles (floating point, an even last dimension), and the next provider in the list runs otherwise.

With AE_PLUGIN_RECORD naming a file, each of them appends one JSON line there the first time it runs
in a process, naming the pid and the process role: the end-to-end test reads where they ran.
It imports only asyncengine.plugins_api, as every plugin should.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.plugins_api import CustomOp, current_process_role, register_op_impl

__all__ = ["PROVIDER", "ExampleRMSNorm", "register", "silu_and_mul_inplace", "supports_silu_and_mul"]

PROVIDER = "ae_example"
_recorded: set[str] = set()


def _record_once(what: str) -> None:
    """One line per `what` and process, only when AE_PLUGIN_RECORD is set."""
    path = os.environ.get("AE_PLUGIN_RECORD")
    if not path or what in _recorded:
        return
    _recorded.add(what)
    with open(path, "a", encoding="utf-8") as record:
        record.write(json.dumps({"what": what, "pid": os.getpid(), "role": current_process_role()}) + "\n")


class ExampleRMSNorm(CustomOp):
    """Built in place of the in-tree RMSNorm, with its constructor arguments; `weight` keeps the
    checkpoint's name, so the model loads it as before."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        _record_once("custom op forward")
        if residual is not None:
            x = x + residual
        # The same roundings as the in-tree op: float32 statistics, the scale applied in x's dtype.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, x)


def supports_silu_and_mul(x: torch.Tensor) -> bool:
    return x.is_floating_point() and x.shape[-1] % 2 == 0


def silu_and_mul_inplace(x: torch.Tensor) -> torch.Tensor:
    _record_once("op provider silu_and_mul")
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # the same product as silu(gate) * up, into the SiLU's own output


def register() -> None:
    CustomOp.register_oot(ExampleRMSNorm, name="RMSNorm")
    register_op_impl("silu_and_mul", PROVIDER, silu_and_mul_inplace, supported=supports_silu_and_mul)
