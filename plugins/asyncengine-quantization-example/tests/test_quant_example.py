"""The int4 method's parts: the packing round trip, layers built with it against float layers, the
frontend's verify_config, and registration (in a fresh interpreter: no torch, no platform)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ae_quant_example.int4 import (
    Int4GroupConfig,
    Int4GroupLinearMethod,
    dequantize_int4,
    group_size_for,
    quantize_int4,
)
from asyncengine.errors import ConfigError
from asyncengine.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from asyncengine.interfaces.quantization import building_with

SRC = Path(__file__).resolve().parent.parent / "src"


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def test_the_round_trip_is_within_half_a_step_per_group_and_packs_two_per_byte():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 64, generator=gen) * torch.linspace(0.01, 2.0, 24)[:, None] + 0.3
    packed, scale, low = quantize_int4(weight, 16)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 32)
    assert scale.dtype == low.dtype == torch.float16 and scale.shape == low.shape == (24, 4)
    restored = dequantize_int4(packed, scale, low, 16, torch.float32)
    step = scale.to(torch.float32).repeat_interleave(16, dim=1)
    assert bool(((restored - weight).abs() <= step / 2 + 1e-3 * weight.abs().max()).all())  # (float16 rounding)
    # Both nibbles are used, each group's range spans 0..15.
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=2).reshape(24, 4, 16)
    assert bool((nibbles.amin(dim=2) == 0).all()) and bool((nibbles.amax(dim=2) == 15).all())
    assert bool((dequantize_int4(*quantize_int4(torch.zeros(2, 8), 8), 8, torch.float32) == 0).all())


def test_weights_on_a_4_bit_grid_come_back_exactly():
    # What a Q4_1 checkpoint holds (the default model's GGUF): per group, m + s * q with q in 0..15.
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (8, 64), generator=gen)
    q[:, ::32], q[:, 1::32] = 0, 15  # each group spans the whole grid, as a quantizer's output does
    m = (torch.randn(8, 2, 1, generator=gen) * 0.1).half().float()
    s = (torch.rand(8, 2, 1, generator=gen) * 0.01 + 0.001).half().float()
    weight = (m + s * q.reshape(8, 2, 32).float()).reshape(8, 64)
    assert torch.equal(dequantize_int4(*quantize_int4(weight, 32), 32, torch.float32), weight)


def test_group_sizes_prefer_32():
    assert [group_size_for(w) for w in (96, 48, 80, 40, 12)] == [32, 16, 16, 8, None]


def test_layers_hold_packed_weights_and_stay_close_to_float(tmp_path, monkeypatch):
    monkeypatch.setenv("AE_PLUGIN_RECORD", str(tmp_path / "record.jsonl"))
    # No engine here: stand in for the worker, where layers are built (restored after the test).
    monkeypatch.setattr("asyncengine.plugin_runtime.records._process_role", "worker rank 0")
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(40, 64, generator=gen) * 0.05, torch.randn(5, 64, generator=gen)
    with building_with(Int4GroupConfig()):
        column = ColumnParallelLinear(64, [(0, 40)], [40], bias=False, dtype=torch.float32)
        rows = [RowParallelLinear((start, start + 32), 64, 40, bias=False, dtype=torch.float32) for start in (0, 32)]
    assert isinstance(column.quant_method, Int4GroupLinearMethod) and column.quant_method.group_size == 32
    column.load(column.weight, weight, None, "w")
    for layer in rows:
        layer.load(layer.weight, weight, None, "w")
    assert column.weight.dtype == torch.uint8 and column.weight.shape == (40, 32)
    assert sum(p.numel() * p.element_size() for p in column.parameters()) == 40 * 32 + 2 * (40 * 2 * 2)
    reference = F.linear(x, weight)
    # Gaussian weights (no grid to land on): ~0.08 relative error (16 levels a group); two row shards too.
    assert relative_error(column(x), reference) < 0.12
    assert relative_error(rows[0](x[:, :32]) + rows[1](x[:, 32:]), reference) < 0.12
    lines = [json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines()]
    assert [(r["event"], r["role"], r["layer"], r["group_size"]) for r in lines] == [
        ("layer built", "worker rank 0", "ColumnParallelLinear", 32),
        ("layer built", "worker rank 0", "RowParallelLinear", 32), ("layer built", "worker rank 0", "RowParallelLinear", 32)]


def test_verify_config_refuses_widths_it_cannot_group(monkeypatch):
    monkeypatch.setattr("asyncengine.plugin_runtime.records._process_role", "frontend")
    hf = SimpleNamespace(hidden_size=96, intermediate_size=160, num_attention_heads=6)
    Int4GroupConfig.verify_config(SimpleNamespace(tensor_parallel_size=2), hf)  # 96, 48, 80: all groupable
    with pytest.raises(ConfigError, match=r"do not divide .*intermediate_size per rank \(down_proj input\) = 10 "
                                          r"\(with tensor_parallel_size=16\)") as caught:
        Int4GroupConfig.verify_config(SimpleNamespace(tensor_parallel_size=16), hf)
    assert caught.value.field == "quantization"


SCRIPT = r"""
import json, sys
import ae_quant_example
from asyncengine.errors import StartupError
from asyncengine.plugins_api import QuantizationRegistry, current_platform

ae_quant_example.register()
ae_quant_example.register()  # idempotent: the same class twice
try:
    current_platform()
    platform = "resolved"
except StartupError:
    platform = "unresolved"
print(json.dumps({"platform": platform, "torch": "torch" in sys.modules,
                  "owner": QuantizationRegistry.owners()["example_int4"]}))
"""


def test_registering_imports_no_torch_and_resolves_no_platform():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"platform": "unresolved", "torch": False, "owner": "the calling script"}
