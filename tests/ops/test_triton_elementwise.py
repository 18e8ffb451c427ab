"""The Triton kernels of ops/ (norm, SiLU-and-mul, rotary, KV store) against their torch references,
and their registration as provider "triton" of the in-tree ops.

The kernels run under the Triton interpreter on CPU, in a subprocess (triton_interpreter_checks.py)
with TRITON_INTERPRET=1: `triton.jit` picks the interpreter when it decorates a kernel, i.e. when the
kernel module is imported, so the variable must be set before that import; setting it in this
process would also leak to any later test of the session that imports a kernel module. With
ASYNCENGINE_KERNEL_DEVICE=cuda (the GPU machine) the same checks run compiled on CUDA tensors
(kernel_device.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kernel_device import device, run_checks

from asyncengine.models.layers import op_registry
from asyncengine.models.layers.activation import silu_and_mul_native
from asyncengine.interfaces.custom_op_registry import OpProviderRegistry
from asyncengine.models.layers.op_registry import call_op, provider_order, providers_of
from asyncengine.plugin_runtime import platform_resolution as resolution
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.platforms.cuda import CudaPlatform
from support.platforms import use_platform

CHECKS = Path(__file__).with_name("triton_interpreter_checks.py")
OPS = ("rms_norm", "rotary", "silu_and_mul")


@pytest.fixture(scope="module")
def interpreter_results():
    results = run_checks(CHECKS, timeout=180)
    assert {r["device"] for r in results} == {device()}
    return results


# (name prefix, how many checks triton_interpreter_checks.py makes: shapes x cos/sin kinds x 3 dtypes)
@pytest.mark.parametrize("kernel, expected", [
    ("rms_norm ", 6), ("fused_add_rms_norm out", 6), ("fused_add_rms_norm residual", 6), ("silu_and_mul", 6),
    ("rotary query", 12), ("rotary key", 12), ("store_kv ", 6), ("store_kv_padding", 6),
])
def test_kernel_matches_its_torch_reference_under_the_interpreter(interpreter_results, kernel, expected):
    mine = [r for r in interpreter_results if r["name"].startswith(kernel)]
    assert len(mine) == expected, f"expected {expected} checks named {kernel!r}, got {[r['name'] for r in mine]}"
    failed = [f"{r['name']}: {r['detail']}" for r in mine if not r["ok"]]
    assert not failed, "kernel differs from its torch reference:\n" + "\n".join(failed)


def test_the_checks_refuse_to_run_without_the_interpreter():
    # On CPU, that is: compiled kernels need the CUDA device.
    env = {key: value for key, value in os.environ.items()
           if key not in ("TRITON_INTERPRET", "ASYNCENGINE_KERNEL_DEVICE")}
    run = subprocess.run([sys.executable, str(CHECKS)], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "TRITON_INTERPRET=1" in run.stderr


# --- registration --------------------------------------------------------------------------------------


@pytest.fixture
def cpu(monkeypatch):
    use_platform(monkeypatch, CpuPlatform)
    monkeypatch.setattr(op_registry, "_chains", {})


def test_each_op_has_a_built_in_triton_provider():
    for op in OPS:
        assert "triton" in providers_of(op)
        assert OpProviderRegistry.owners()[f"{op}/triton"] == "built-in"
        assert OpProviderRegistry.get(f"{op}/triton").implementation.startswith("asyncengine.ops.triton_")


def test_supported_is_false_for_cpu_tensors_and_true_only_for_cuda_ones():
    x = torch.randn(2, 8)
    assert not op_registry.on_cuda(x, torch.ones(8), 1e-6)
    assert not op_registry.on_cuda(x, x, x, x)
    # the predicate reads attributes only: a stand-in shows what a CUDA tensor would get
    fake_cuda = SimpleNamespace(is_cuda=True, dtype=torch.float16)
    assert op_registry.on_cuda(fake_cuda, fake_cuda, 1e-6)
    assert not op_registry.on_cuda(fake_cuda, x)  # mixed devices: declined
    assert not op_registry.on_cuda(SimpleNamespace(is_cuda=True, dtype=torch.int8))
    assert not op_registry.on_cuda(1e-6)  # no tensor at all


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's view")
def test_on_a_machine_without_cuda_the_triton_providers_are_left_out(cpu, monkeypatch):
    assert not op_registry.triton_runs_here()
    for op in OPS:
        assert provider_order(op) == (["native"], "registered priorities")
    monkeypatch.setattr("asyncengine.plugin_runtime.records._process_role", "worker rank 0")
    records = {r.plugin: r.reason for r in op_registry.startup_records("load model")}
    for op in OPS:  # as before the triton providers existed
        assert records[f"op:{op}"] == "provider native (priority list: native; from registered priorities)"


def test_where_triton_runs_it_comes_first_yet_cpu_tensors_still_run_native(cpu, monkeypatch):
    monkeypatch.setattr(op_registry, "_triton_runs_here", True)
    assert provider_order("silu_and_mul") == (["native"], "registered priorities")  # the CPU platform: no triton
    use_platform(monkeypatch, CudaPlatform)
    monkeypatch.setattr(op_registry, "_chains", {})
    assert provider_order("silu_and_mul") == (["triton", "native"], "registered priorities")
    x = torch.randn(3, 8)
    # supported() declines CPU tensors: the call falls through to native (a kernel given CPU tensors
    # outside the interpreter would fail, so this equality shows it was not called)
    assert torch.equal(call_op("silu_and_mul", x), silu_and_mul_native(x))
