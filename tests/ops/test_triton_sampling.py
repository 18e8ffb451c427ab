"""Op "sample" (the sampler's draw): the Triton kernel against its torch reference (in a child process,
triton_sampling_checks.py: interpreted on CPU, compiled on CUDA with ASYNCENGINE_KERNEL_DEVICE=cuda),
the native provider against the same reference, the op's registration, and the Sampler's per-row seeds
for the in-kernel draw.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kernel_device import device, run_checks
from support.platforms import use_platform

from asyncengine.models.layers import op_registry
from asyncengine.interfaces.custom_op_registry import OpProviderRegistry
from asyncengine.models.layers.op_registry import call_op, provider_order, register_op_impl
from asyncengine.plugin_runtime import platform_resolution as resolution
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.wire.engine_core import SamplingOptions
from asyncengine.worker.sample_op import sample_native
from asyncengine.worker.sampler import Sampler, SamplingRow

CHECKS = Path(__file__).with_name("triton_sampling_checks.py")


@pytest.fixture(scope="module")
def kernel_results():
    results = run_checks(CHECKS, timeout=300)
    assert {r["device"] for r in results} == {device()}
    return results


# (name prefix, how many checks triton_sampling_checks.py makes: 3 dtypes x 2 vocabularies, ...)
@pytest.mark.parametrize("check, expected", [
    ("given noise ", 6), ("in-kernel philox ", 6), ("greedy ties first index ", 3), ("masked tokens never drawn", 1),
    ("same seed same token", 1), ("other seeds other tokens", 1), ("frequencies kernel ", 2),
    ("frequencies philox noise", 1),
])
def test_sample_kernel_matches_its_reference(kernel_results, check, expected):
    mine = [r for r in kernel_results if r["name"].startswith(check)]
    assert len(mine) == expected, f"expected {expected} checks named {check!r}, got {[r['name'] for r in mine]}"
    failed = [f"{r['name']}: {r['detail']}" for r in mine if not r["ok"]]
    assert not failed, "the sample kernel is wrong:\n" + "\n".join(failed)


def test_the_checks_refuse_to_run_on_cpu_without_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ASYNCENGINE_KERNEL_DEVICE")}
    run = subprocess.run([sys.executable, str(CHECKS)], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "TRITON_INTERPRET=1" in run.stderr


COMPILE_FOR_H200 = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from asyncengine.ops.triton_sampling import _sample_kernel
for has_noise, logits in [(False, "*bf16"), (True, "*fp32"), (False, "*fp16")]:
    signature = dict(logits_ptr=logits, temperature_ptr="*fp32", seeds_ptr="*i64",
                     noise_ptr="*fp32" if has_noise else logits,
                     best_score_ptr="*fp32", best_index_ptr="*i32", logits_row_stride="i32", noise_row_stride="i32",
                     vocab="i32", tiles_per_split="i32", splits="i32", HAS_NOISE="constexpr", BLOCK="constexpr")
    source = ASTSource(_sample_kernel, signature, constexprs={"HAS_NOISE": has_noise, "BLOCK": 1024})
    print(logits, has_noise, len(compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]))
"""


@pytest.mark.skipif(shutil.which("ptxas") is None and not os.environ.get("TRITON_PTXAS_PATH"),
                    reason="no ptxas to compile with")
def test_the_kernel_compiles_for_the_h200_without_one():
    # The interpreter runs Python, so it lets through what the compiler refuses (a global that is
    # not a constexpr, say): compile for sm_90 here, no GPU needed, rather than on the lent one.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE_FOR_H200], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"the sample kernel does not compile for sm_90:\n{run.stderr[-3000:]}"
    assert len(run.stdout.splitlines()) == 3 and all(int(line.split()[-1]) > 0 for line in run.stdout.splitlines())


# --- the native provider ----------------------------------------------------------------------------


def test_native_provider_draws_the_reference_token_on_the_same_noise():
    from asyncengine.ops.triton_sampling import sample_reference  # importing a kernel module: no launch

    generator = torch.Generator().manual_seed(11)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1e-5, 50.0] * 40)
    logits = torch.randn(len(temperature), 257, generator=generator) * 4
    noise = torch.empty(logits.shape).exponential_(generator=generator)
    got = sample_native(logits, temperature, torch.zeros(len(temperature), dtype=torch.int64), noise)
    want = sample_reference(logits, temperature, noise)
    # softmax(x / T) / E and x / T - log E order the tokens alike; only a near tie could round apart.
    differ = (got != want).nonzero().flatten().tolist()
    assert len(differ) <= 1, f"rows {differ} differ"
    assert torch.equal(got[temperature == 0], logits[temperature == 0].argmax(dim=-1))
    assert got.dtype == torch.int64


def test_native_provider_without_noise_draws_from_the_seeds():
    flat = torch.zeros(32, 100)
    ones = torch.ones(32)
    seeds = torch.arange(32, dtype=torch.int64) * 1_000_003 - 2**62
    first = sample_native(flat, ones, seeds, None)
    assert torch.equal(first, sample_native(flat, ones, seeds, None))
    assert torch.equal(first[5:6], sample_native(flat[5:6], ones[5:6], seeds[5:6], None))  # per row
    assert len(set(first.tolist())) > 16  # 32 draws over 100 equal tokens
    assert not torch.equal(first, sample_native(flat, ones, seeds + 1, None))
    greedy = torch.randn(3, 100)
    assert torch.equal(sample_native(greedy, torch.zeros(3), seeds[:3], None), greedy.argmax(dim=-1))


# --- registration -------------------------------------------------------------------------------------


@pytest.fixture
def cpu(monkeypatch):
    use_platform(monkeypatch, CpuPlatform)
    monkeypatch.setattr(op_registry, "_chains", {})
    monkeypatch.setattr(OpProviderRegistry, "_entries", dict(OpProviderRegistry._entries))
    monkeypatch.setattr(op_registry, "_options", dict(op_registry._options))


def test_sample_has_a_native_and_a_built_in_triton_provider():
    owners = OpProviderRegistry.owners()
    assert owners["sample/native"] == owners["sample/triton"] == "built-in"
    assert OpProviderRegistry.get("sample/triton").implementation == "asyncengine.ops.triton_sampling:sample_triton"
    assert "sample" in op_registry.op_names()


def test_the_triton_provider_takes_only_cuda_tensors_of_the_right_dtypes():
    def fake(dtype, cuda=True):  # the predicate reads attributes only: a stand-in for a CUDA tensor
        return SimpleNamespace(is_cuda=cuda, dtype=dtype)

    ok = (fake(torch.bfloat16), fake(torch.float32), fake(torch.int64))
    assert op_registry.sample_on_cuda(*ok, None)
    assert op_registry.sample_on_cuda(*ok, fake(torch.float32))
    assert not op_registry.sample_on_cuda(*ok, fake(torch.float32, cuda=False))
    assert not op_registry.sample_on_cuda(fake(torch.bfloat16), fake(torch.float32), fake(torch.int32), None)
    assert not op_registry.sample_on_cuda(fake(torch.int8), fake(torch.float32), fake(torch.int64), None)
    assert not op_registry.sample_on_cuda(torch.zeros(2, 4), torch.ones(2), torch.zeros(2, dtype=torch.int64), None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's view")
def test_on_cpu_the_sampler_draws_through_native(cpu):
    assert provider_order("sample") == (["native"], "registered priorities")


def test_a_plugin_provider_replaces_the_draw_of_the_sampler(cpu):
    calls = []

    def last_token(logits, temperature, seeds, noise):
        calls.append((tuple(logits.shape), temperature.tolist(), noise is None))
        return torch.full((logits.shape[0],), logits.shape[1] - 1, dtype=torch.int64)

    register_op_impl("sample", "last", last_token, priority=5)
    rows = [SamplingRow(SamplingOptions(temperature=t), [0], []) for t in (0.0, 0.5)]
    out = Sampler(8, torch.device("cpu"), 0)(torch.randn(2, 8), rows)
    assert out.token_ids == [7, 7]
    assert calls == [((2, 8), [0.0, 0.5], False)]  # greedy row at 0, noise drawn on the host (CPU)
    assert torch.equal(call_op("sample", torch.zeros(1, 3), torch.ones(1), torch.zeros(1, dtype=torch.int64), None),
                       torch.tensor([2]))


# --- the Sampler's seeds for an in-kernel draw ----------------------------------------------------------


def _row(seed=None, position=0, temperature=1.0):
    return SamplingRow(SamplingOptions(temperature=temperature, seed=seed), [0], [1] * position)


def test_a_seeded_rows_seed_depends_on_its_seed_and_position_only():
    a, b = Sampler(8, torch.device("cpu"), 1), Sampler(8, torch.device("cpu"), 2)
    a._row_seeds([_row() for _ in range(5)])  # a used engine stream must not matter
    row = _row(seed=1234, position=3)
    (alone,) = a._row_seeds([row])
    assert b._row_seeds([_row(), row, _row(temperature=0.0)])[1] == alone
    assert a._row_seeds([_row(seed=1234, position=4)])[0] != alone
    assert a._row_seeds([_row(seed=1235, position=3)])[0] != alone
    for seed in (0, -1, 2**63 - 1, 2**64 + 5, -(2**70)):  # any Python int: a valid int64 comes out
        (value,) = a._row_seeds([_row(seed=seed)])
        assert -2**63 <= value < 2**63


def test_unseeded_rows_get_fresh_seeds_reproducible_from_the_engine_seed():
    rows = [_row() for _ in range(16)]
    first = Sampler(8, torch.device("cpu"), 5)
    seeds = first._row_seeds(rows) + first._row_seeds(rows)
    assert len(set(seeds)) == 32  # per row and per call
    again = Sampler(8, torch.device("cpu"), 5)
    assert again._row_seeds(rows) + again._row_seeds(rows) == seeds
    assert set(Sampler(8, torch.device("cpu"), 6)._row_seeds(rows)).isdisjoint(seeds)
    assert first._row_seeds([_row(temperature=0.0)]) == [0]  # greedy rows use none
