"""ExampleRMSNorm and the silu_and_mul provider on plain torch tensors; registration in a fresh interpreter
(it changes process-wide registries, which the other tests of this session must not see)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ae_custom_ops_example
from ae_custom_ops_example import ExampleRMSNorm, silu_and_mul_inplace, supports_silu_and_mul
from asyncengine.models.layers.norm import rms_norm_native  # the in-tree reference it must equal

SRC = Path(__file__).resolve().parent.parent / "src"


@pytest.fixture(autouse=True)
def no_record(monkeypatch):
    monkeypatch.delenv("AE_PLUGIN_RECORD", raising=False)
    monkeypatch.setattr(ae_custom_ops_example, "_recorded", set())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_equals_the_in_tree_one_to_the_bit(dtype):
    torch.manual_seed(0)
    norm = ExampleRMSNorm(16, 1e-6, dtype=dtype)
    norm.weight.data = torch.randn(16).to(dtype)
    x, residual = torch.randn(5, 16).to(dtype), torch.randn(5, 16).to(dtype)
    assert torch.equal(norm.forward_native(x), rms_norm_native(x, norm.weight, 1e-6))
    out, summed = norm.forward_native(x, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(out, rms_norm_native(x + residual, norm.weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_provider_equals_silu_times_up_to_the_bit(dtype):
    x = torch.randn(7, 12).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul_inplace(x), F.silu(gate) * up)


def test_the_provider_accepts_only_what_it_handles():
    assert supports_silu_and_mul(torch.zeros(3, 8))
    assert not supports_silu_and_mul(torch.zeros(3, 7))  # no even split into gate and up
    assert not supports_silu_and_mul(torch.zeros(3, 8, dtype=torch.int64))


def test_each_records_once_per_process(tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("AE_PLUGIN_RECORD", str(record))
    # No engine runs here, so there is no process role to read: stand in for the worker's.
    monkeypatch.setattr(ae_custom_ops_example, "current_process_role", lambda: "worker rank 0")
    norm = ExampleRMSNorm(4, 1e-6, dtype=torch.float32)
    for _ in range(2):
        norm.forward_native(torch.ones(1, 4))
        silu_and_mul_inplace(torch.ones(1, 4))
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert lines == [{"what": "custom op forward", "pid": os.getpid(), "role": "worker rank 0"},
                     {"what": "op provider silu_and_mul", "pid": os.getpid(), "role": "worker rank 0"}]


REGISTER = r"""
import json
from ae_custom_ops_example import ExampleRMSNorm, register
from asyncengine.models.layers import op_registry
from asyncengine.models.layers.norm import RMSNorm
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.plugin_runtime.platform_resolution import set_current_platform

register()
register()  # a second call (a second engine in the process) is a no-op
set_current_platform(CpuPlatform)
built = RMSNorm(8, 1e-6, dtype=__import__("torch").float32)
print(json.dumps({"built": type(built).__name__, "order": op_registry.provider_order("silu_and_mul")[0],
                  "oot": op_registry.CustomOpRegistry.get("oot:RMSNorm").owner}))
"""


def test_register_replaces_rms_norm_and_adds_the_provider_in_a_fresh_interpreter():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", REGISTER], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"built": "ExampleRMSNorm", "order": ["ae_example", "native"],
                                         "oot": "the calling script"}
