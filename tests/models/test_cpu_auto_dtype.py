"""dtype="auto" on CPU: bfloat16 where the CPU has AMX or AVX-512 BF16, float32 elsewhere
(asyncengine/platforms/cpu.py), and ASYNCENGINE_CPU_AUTO_DTYPE naming it instead.

The suite's conftest sets ASYNCENGINE_CPU_AUTO_DTYPE=float32 for every other test; these clear it.
"""

from __future__ import annotations

import pytest

from asyncengine.platforms import cpu
from asyncengine.platforms.cpu import AUTO_DTYPE_ENV, CpuPlatform


@pytest.mark.parametrize(("flags", "expected"), [
    ({"fpu", "avx512f", "amx_tile", "amx_bf16"}, "bfloat16"),
    ({"fpu", "avx512f", "avx512_bf16"}, "bfloat16"),
    ({"fpu", "avx2", "avx512f"}, "float32"),  # AVX-512 without BF16: bfloat16 matmuls are emulated there
    (set(), "float32"),  # no /proc/cpuinfo (or not x86 flags)
])
def test_auto_follows_the_cpu_flags(monkeypatch, flags, expected):
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    assert CpuPlatform.default_dtype == expected


def test_the_environment_names_it_instead(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    monkeypatch.setenv(AUTO_DTYPE_ENV, "float32")
    assert CpuPlatform.default_dtype == "float32"


def test_this_machines_flags_are_read():
    flags = cpu.cpu_flags()
    with open("/proc/cpuinfo") as cpuinfo:
        text = cpuinfo.read()
    assert all(flag in text for flag in flags)
    assert ("amx_bf16" in text.split() or "avx512_bf16" in text.split()) == bool(flags & set(cpu.BF16_CPU_FLAGS))


def test_an_engine_with_dtype_auto_builds_the_model_in_the_cpus_default(monkeypatch, tiny_model, make_llm):
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    expected = "bfloat16" if cpu.cpu_flags() & set(cpu.BF16_CPU_FLAGS) else "float32"
    llm = make_llm(str(tiny_model("llama").path), skip_tokenizer_init=True, max_model_len=64)
    assert llm.engine.model_config.dtype == expected
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], None)
    assert len(out[0].outputs[0].token_ids) > 0
