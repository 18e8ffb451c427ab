"""The int8 kernels of ops/cpu_int8.py against their torch references (models/layers/quantization.py):
bit-equal in float32 and bfloat16, on strided rows, rows of zeros, tiny and huge values, no rows; and the
`int8_dynamic` layer gives the same result through them as through the torch ops."""

from __future__ import annotations

import pytest
import torch

from asyncengine.models.layers import quantization
from asyncengine.models.layers.linear import ColumnParallelLinear
from asyncengine.models.layers.quantization import Int8DynamicConfig, quantize_rows_int8
from asyncengine.interfaces.quantization import building_with
from asyncengine.ops import cpu_int8

pytestmark = pytest.mark.skipif(not cpu_int8.available(torch.float32),
                                reason=f"int8 CPU kernels not built: {cpu_int8.unavailable_reason()}")


def rows_with_extremes(dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(41, 600, generator=generator) * torch.logspace(-6, 6, 41)[:, None]
    x[0] = 0.0  # the scale's floor (1e-12 / 127)
    x[1] = 1e-30  # below the floor: every value rounds to 0
    x[2, ::7] = -3e38  # near float32's largest
    x[3, 5] = float("inf")  # an infinite scale (the infinity itself becomes NaN: both cast it alike)
    x[4, :] = 0.5  # exact halves of the scale: round half to even
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_is_bit_equal_to_the_reference(dtype):
    x = rows_with_extremes(dtype)
    for rows in (x, x[:, 8:520], x[:0]):  # whole rows, a strided view of them, no rows
        q, scale = cpu_int8.quantize_rows(rows)
        q_ref, scale_ref = quantize_rows_int8(rows)
        assert q.dtype == torch.int8 and scale.shape == (rows.shape[0], 1)
        assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_rows_is_bit_equal_to_the_reference(dtype):
    generator = torch.Generator().manual_seed(5)
    acc = torch.randint(-2**31, 2**31 - 1, (33, 257), generator=generator, dtype=torch.int32)
    x_scale = torch.rand(33, 1, generator=generator) * 3
    w_scale = torch.rand(257, generator=generator) / 50
    ours = cpu_int8.scale_rows(acc, x_scale, w_scale, dtype)
    assert ours.dtype == dtype and torch.equal(ours, (acc * (x_scale * w_scale)).to(dtype))


def test_wrong_layouts_are_refused():
    with pytest.raises(ValueError, match="unit stride"):
        cpu_int8.quantize_rows(torch.zeros(4, 6).t())
    with pytest.raises(ValueError, match="int32 sums"):
        cpu_int8.scale_rows(torch.zeros(2, 3), torch.ones(2, 1), torch.ones(3), torch.float32)


@pytest.mark.parametrize("rows", [1, 32])
def test_the_int8_dynamic_layer_gives_the_same_result_without_the_kernels(rows, monkeypatch):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 160, generator=generator)
    with building_with(Int8DynamicConfig()):
        layer = ColumnParallelLinear(160, [(0, 96)], [96], bias=False, dtype=torch.float32)
    layer.load(layer.weight, weight, None, "w")
    quantization.process_weights_after_loading(layer)
    x = torch.randn(rows, 160, generator=generator) * 4
    calls = []
    real = cpu_int8.quantize_rows
    monkeypatch.setattr(cpu_int8, "quantize_rows", lambda t: calls.append(1) or real(t))
    through_kernels = layer(x)
    assert calls == [1]
    monkeypatch.setattr(cpu_int8, "available", lambda dtype: False)
    assert torch.equal(through_kernels, layer(x))


def test_a_nan_row_quantizes_as_the_reference_does():
    x = torch.randn(3, 64)
    x[1, 7] = float("nan")  # the row's scale is NaN in both (torch's amax and clamp keep it)
    q, scale = cpu_int8.quantize_rows(x)
    q_ref, scale_ref = quantize_rows_int8(x)
    assert torch.isnan(scale_ref[1]).item()
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(q, q_ref)
