"""Where the kernel checks run: the Triton interpreter on CPU tensors (the default, and CI's), or
compiled on CUDA tensors when ASYNCENGINE_KERNEL_DEVICE=cuda (bench/gpu.py sets it on the GPU machine).

The checks run in a child process (see test_triton_elementwise.py for why): `child_env()` is its
environment, `run_checks(script)` runs one and returns its JSON lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VARIABLE = "ASYNCENGINE_KERNEL_DEVICE"


def device() -> str:
    value = os.environ.get(VARIABLE, "cpu")
    if value not in ("cpu", "cuda"):
        raise ValueError(f"{VARIABLE}={value!r}: use 'cpu' (the Triton interpreter) or 'cuda' (compiled kernels)")
    return value


def child_env() -> dict[str, str]:
    """On CPU: TRITON_INTERPRET=1 (the kernels are interpreted); on CUDA: without it (compiled)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env[VARIABLE] = device()
    if device() == "cpu":
        env["TRITON_INTERPRET"] = "1"
    return env


def run_checks(script: Path, timeout: int = 300) -> list[dict]:
    run = subprocess.run([sys.executable, str(script)], env=child_env(), capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, f"{script.name} failed to run on {device()}:\n{run.stderr[-3000:]}"
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
