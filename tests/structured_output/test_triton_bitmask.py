"""The Triton bitmask kernel against its torch reference (interpreted on CPU, compiled on CUDA with
ASYNCENGINE_KERNEL_DEVICE=cuda), in a child process: TRITON_INTERPRET must be set before the kernel
module is imported, and setting it here would leak into every later test that imports a kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = Path(__file__).with_name("triton_bitmask_checks.py")
DEVICE = os.environ.get("ASYNCENGINE_KERNEL_DEVICE", "cpu")


@pytest.fixture(scope="module")
def results():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, str(CHECKS)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_the_kernel_masks_exactly_as_the_torch_reference(results):
    assert len(results) == 12 and {r["device"] for r in results} == {DEVICE}
    failed = [f"{r['name']}: {r['detail']}" for r in results if not r["ok"]]
    assert not failed, "the kernel differs from its torch reference:\n" + "\n".join(failed)


def test_the_checks_refuse_to_run_on_cpu_without_the_interpreter():
    env = {key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", "ASYNCENGINE_KERNEL_DEVICE")}
    run = subprocess.run([sys.executable, str(CHECKS)], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "TRITON_INTERPRET=1" in run.stderr
