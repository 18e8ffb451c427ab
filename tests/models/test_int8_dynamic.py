"""The int8 methods' fast paths (models/layers/quantization.py): `int8_dynamic` (int8 weights, activations
quantized per row, an int8 matmul) against its float64 reference, row by row independent of the batch, close
to float; and `int8`'s packed kernel for a few bfloat16 rows against its own dequantizing path."""

from __future__ import annotations

import pytest
import torch

from asyncengine import SamplingParams
from asyncengine.models.layers import quantization
from asyncengine.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from asyncengine.models.layers.quantization import (
    Int8Config,
    Int8DynamicConfig,
    dequantize_int8,
    int8_dynamic_reference,
)
from asyncengine.interfaces.quantization import building_with


def linear(cls, config, weight):
    with building_with(config):
        if cls is ColumnParallelLinear:
            layer = cls(weight.shape[1], [(0, weight.shape[0])], [weight.shape[0]], bias=False, dtype=torch.float32)
        else:
            layer = cls((0, weight.shape[1]), weight.shape[1], weight.shape[0], bias=False, dtype=torch.float32)
    layer.load(layer.weight, weight, None, "w")
    return layer


def weights_and_inputs(rows, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(96, 160, generator=generator) * torch.linspace(0.05, 2.0, 96)[:, None]
    x = torch.randn(rows, 160, generator=generator) * torch.linspace(0.1, 10.0, rows)[:, None]
    return weight, x


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_int8_dynamic_computes_its_reference_and_stays_close_to_float(cls, rows):
    weight, x = weights_and_inputs(rows)
    layer = linear(cls, Int8DynamicConfig(), weight)
    assert layer.weight.dtype == torch.int8
    ours = layer(x)
    reference = int8_dynamic_reference(x, layer.weight, layer.weight_scale)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6 * float(reference.abs().max()))
    exact = x @ weight.t()
    assert float((ours - exact).norm() / exact.norm()) < 2e-2


def test_int8_dynamic_gives_each_row_the_same_result_alone_or_in_a_batch():
    """Each row has its own activation scale, so a sequence's numbers do not depend on its batch."""
    weight, x = weights_and_inputs(9)
    layer = linear(ColumnParallelLinear, Int8DynamicConfig(), weight)
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(9)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("rows", [1, 5, 16, 17])
def test_int8_bfloat16_rows_agree_with_the_dequantizing_path(rows, monkeypatch):
    weight, x = weights_and_inputs(rows, seed=1)
    layer = linear(ColumnParallelLinear, Int8Config(), weight)
    x = x.to(torch.bfloat16)
    calls = []
    real = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: calls.append(1) or real(*a))
    ours = layer(x)
    assert calls == ([1] if rows <= quantization.INT8PACK_MAX_ROWS else [])
    dequantized = (x.float() @ dequantize_int8(layer.weight, layer.weight_scale, torch.bfloat16).float().t())
    torch.testing.assert_close(ours.float(), dequantized, rtol=2e-2, atol=2e-2 * float(dequantized.abs().max()))


def test_an_int8_dynamic_engine_generates_with_int8_linear_weights(tiny_model):
    from asyncengine import LLM

    options = dict(skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=2**20, plugins="",
                   dtype="float32")
    with LLM(str(tiny_model("llama").path), quantization="int8_dynamic", **options) as llm:
        described = llm.collective_rpc("describe")[0]
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    # Every q/k/v/o/gate/up/down weight: 1 byte per element and a float32 scale per output row.
    hf = tiny_model("llama").hf_model
    projections = [p for name, p in hf.named_parameters() if name.endswith("proj.weight")]
    elements, rows = sum(p.numel() for p in projections), sum(p.shape[0] for p in projections)
    float_bytes = sum(p.numel() * 4 for p in hf.parameters())
    assert described["parameter_bytes"] == float_bytes - 4 * elements + elements + 4 * rows
