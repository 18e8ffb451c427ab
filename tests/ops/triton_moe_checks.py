"""Run by test_fused_moe.py in a subprocess (see triton_interpreter_checks.py for why): the Triton MoE kernel
(ops/triton_moe.py) against fused_moe_reference on a few of moe_cases.py's random problems, kept tiny because
the interpreter is slow, under TRITON_INTERPRET=1 on CPU or compiled with ASYNCENGINE_KERNEL_DEVICE=cuda.
Prints one JSON line per check: {"name", "ok", "detail", "device", "reached"}."""

from __future__ import annotations

import json
import os
import sys

DEVICE = os.environ.get("ASYNCENGINE_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (on CPU the kernels are checked under the Triton interpreter), "
             "or with ASYNCENGINE_KERNEL_DEVICE=cuda on a GPU machine")

import torch  # noqa: E402
from moe_cases import as_rows_of_their_experts, coverage, make_case, max_error  # noqa: E402

from asyncengine.ops.fused_moe import fused_moe_reference  # noqa: E402
from asyncengine.ops.triton_moe import fused_moe_triton  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference without TF32, as the kernel's "ieee" dots
if DEVICE == "cpu":
    torch.set_num_threads(1)  # the interpreter's many small torch ops: two threads only wait on each other here

# Seeds whose problems, together, have: GPT-OSS's activation with biases, a slice of the experts held here
# with tokens that pick none of them, M = 1 with top-8, experts that get no token (moe_cases.py draws them).
SEEDS = (44, 11, 3)
for dtype in (torch.float32, torch.bfloat16):
    # and, in float32, seed 44's rows as a rank receives them under expert parallelism (each for one of its
    # experts, chosen alone by -inf logits elsewhere, top-1)
    problems = [make_case(seed, dtype, device=DEVICE, sizes=(32,), inners=(32,)) for seed in SEEDS]
    if dtype == torch.float32:
        problems.append(as_rows_of_their_experts(problems[0], 0))
    for case in problems:
        want = fused_moe_reference(*case.args)
        got = fused_moe_triton(*case.args)
        error, allowed = max_error(got, want)
        ok = got.shape == want.shape and got.dtype == want.dtype and error <= allowed
        print(json.dumps({"name": f"fused_moe_triton {case.name}", "ok": bool(ok), "device": DEVICE,
                          "detail": f"max error {error:.3g}, allowed {allowed:.3g}",
                          "reached": sorted(coverage([case]))}), flush=True)
