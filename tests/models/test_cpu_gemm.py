"""CPU linear layers through oneDNN with reordered weights (asyncengine/models/layers/cpu_gemm.py):
the same results as F.linear, used by the plain linear layers and the LM head once loaded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncengine.models.layers import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.enabled(), reason="torch without oneDNN")


def _cpu_has_bf16_gemm() -> bool:
    # oneDNN's bfloat16 reorder needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU has neither.
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    return {"avx512bw", "avx512vl", "avx512dq"} <= set(flags) or "avx_ne_convert" in flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17, 32, 100, 1000])  # 17, 100 and 1000 are padded (to 18, 104, 1024)
def test_reordered_weight_gives_f_linear_results(dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    x = torch.randn(rows, 40, generator=generator).to(dtype)
    packed = cpu_gemm.pack(weight)
    if dtype == torch.bfloat16 and not _cpu_has_bf16_gemm():
        assert packed is None  # oneDNN refuses: the layer keeps F.linear (checked below all the same)
    else:
        assert packed is not None
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for b in (None, bias):
        torch.testing.assert_close(cpu_gemm.linear(x, weight, packed, b).float(), F.linear(x, weight, b).float(),
                                   atol=tolerance, rtol=tolerance)


def test_row_counts_are_bucketed_to_few_sizes():
    # oneDNN makes and caches a primitive per shape: a step's token count, bucketed, takes few shapes (issue 30's
    # soak: the engine core grew with every new count).
    buckets = [cpu_gemm.rows_bucket(rows) for rows in range(1, 8193)]
    assert buckets[:16] == list(range(1, 17))  # small batches exact
    assert all(rows <= bucket <= rows * 1.125 for rows, bucket in enumerate(buckets, 1))
    assert buckets == sorted(buckets) and len(set(buckets)) == 88


def test_padded_rows_do_not_reach_the_result(monkeypatch):
    seen = []
    pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(cpu_gemm.torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *args: seen.append(x.shape[0]) or pointwise(x, *args), raising=False)
    weight = torch.randn(64, 32)
    x = torch.randn(100, 32)
    out = cpu_gemm.linear(x, weight, cpu_gemm.pack(weight))
    assert seen == [104] and out.shape == (100, 64)
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_what_does_not_apply_is_not_packed(monkeypatch):
    assert cpu_gemm.pack(torch.zeros(4, 4, dtype=torch.float16)) is None
    monkeypatch.setenv("ASYNCENGINE_CPU_KERNELS", "0")
    assert cpu_gemm.pack(torch.zeros(4, 4)) is None


def test_a_loaded_model_runs_its_linear_layers_and_head_through_the_reordered_weights(tiny_model, make_llm,
                                                                                       monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_gemm, "linear", _counting(cpu_gemm.linear, calls))
    llm = make_llm(str(tiny_model("llama").path), skip_tokenizer_init=True, max_model_len=64)
    before = len(calls)
    # Prompts of more than 8 tokens in all: steps of up to 8 new tokens run the one-call decode step
    # (worker/cpu_decode.py), which reads the weights itself; a longer prefill runs the modules' linear layers.
    llm.generate([{"prompt_token_ids": list(range(5, 17))}, {"prompt_token_ids": list(range(20, 29))}], None)
    packed = [c for c in calls[before:] if c]
    assert packed, "no linear layer ran through a reordered weight"


def _counting(linear, calls):
    def wrapped(x, weight, packed, bias=None):
        calls.append(packed is not None)
        return linear(x, weight, packed, bias)
    return wrapped
