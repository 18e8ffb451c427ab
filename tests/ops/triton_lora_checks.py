"""Run by test_triton_lora.py in a subprocess (see triton_interpreter_checks.py for why): the LoRA shrink and
expand kernels (ops/triton_lora.py) against their torch references, under TRITON_INTERPRET=1 on CPU, or compiled
with ASYNCENGINE_KERNEL_DEVICE=cuda. Prints one JSON line per check: {"name", "ok", "detail", "device"}."""

from __future__ import annotations

import json
import os
import sys

DEVICE = os.environ.get("ASYNCENGINE_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (on CPU the kernels are checked under the Triton interpreter), "
             "or with ASYNCENGINE_KERNEL_DEVICE=cuda on a GPU machine")

import torch  # noqa: E402

from asyncengine.ops import triton_lora  # noqa: E402

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
generator = torch.Generator().manual_seed(0)


def report(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    ok = got.shape == want.shape and torch.allclose(got.float().cpu(), want.float().cpu(), rtol=rtol, atol=atol)
    detail = f"max error {float((got.float().cpu() - want.float().cpu()).abs().max()):.3g}" if got.shape == want.shape \
        else f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    print(json.dumps({"name": name, "ok": bool(ok), "detail": detail, "device": DEVICE}), flush=True)


# (tokens, in, width = fused projections x padded rank, out, slots): odd sizes cross the blocks' edges.
SHAPES = [(7, 96, 24, 160, 3), (33, 130, 16, 70, 4)]
# float32 on both shapes; bfloat16 (the kernels accumulate in float32, round once) on the first only, to keep the
# interpreter's time down.
for dtype, shapes in ((torch.float32, SHAPES), (torch.bfloat16, SHAPES[:1])):
    for tokens, in_features, width, out_features, slots in shapes:
        x = torch.randn(tokens, in_features, generator=generator).to(dtype).to(DEVICE)
        a = torch.randn(slots, width, in_features, generator=generator).to(dtype).to(DEVICE)
        b = torch.randn(slots, width, out_features, generator=generator).to(dtype).to(DEVICE)
        # every slot, and the base model (-1), mixed in one batch
        token_slots = torch.tensor([(t % (slots + 1)) - 1 for t in range(tokens)], dtype=torch.int64).to(DEVICE)
        label = f"{tokens}x{in_features} W={width} out={out_features} {str(dtype).split('.')[-1]}"
        h = triton_lora.lora_shrink(x, a, token_slots)
        report(f"lora_shrink {label}", h, triton_lora.lora_shrink_reference(x, a, token_slots), dtype)
        y = torch.randn(tokens, out_features, generator=generator).to(dtype).to(DEVICE)
        want = triton_lora.lora_expand_reference(y, h, b, token_slots)
        got = triton_lora.lora_expand(y.clone(), h, b, token_slots)
        report(f"lora_expand {label}", got, want, dtype)
