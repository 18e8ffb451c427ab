"""The block-quantized int8 kernel of ops/cpu_block_int8.py (`quantization="gguf"`) against its torch references:
the activations' per-block quantization bit-equal, the product equal to the float64 reference to float32
summation (bfloat16: to the output's rounding), for every remainder of the kernel's 6-row and 32-column tiles,
with and without offsets, blocks of zeros, non-finite blocks, strided rows and no rows."""

from __future__ import annotations

import pytest
import torch

from asyncengine.ops import cpu_block_int8 as kernel

pytestmark = pytest.mark.skipif(not kernel.available(torch.float32),
                                reason=f"block int8 CPU kernel not built: {kernel.unavailable_reason()}")


def blocks(n: int, width: int, offset: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, width), generator=generator, dtype=torch.int8)
    scale = torch.rand(n, width // 32, generator=generator) * 0.01
    scale[0, 0] = 0.0  # a block of zeros in the file
    return q, scale, ((torch.rand(n, width // 32, generator=generator) - 0.5) * 0.1 if offset else None)


def activations(rows: int, width: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator) * torch.logspace(-3, 3, rows)[:, None]
    if rows > 2:
        x[1, :32] = 0.0  # a block of zeros: scale 0
        x[2, 32:64] = torch.arange(32) - 15.5  # with 127 the largest, the scale is 1: exact halves, half to even
        x[2, 63] = 127.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_is_bit_equal_to_the_reference(dtype):
    x = activations(13, 256, dtype)
    for rows in (x, x[:, 64:192], x[:0]):  # whole rows, a strided view of them, no rows
        xq, dx, sx = kernel.quantize_activations(rows)
        q_ref, dx_ref = kernel.quantize_activations_reference(rows)
        assert torch.equal(xq.to(torch.int32) - 128, q_ref) and torch.equal(dx, dx_ref)
        sums = q_ref.reshape(rows.shape[0], rows.shape[1] // 32, 32).sum(dim=2).to(torch.float32)
        assert torch.equal(sx, dx_ref * sums)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32])
def test_the_product_is_the_float64_reference(dtype, offset, rows):
    n, width = 80, 192  # 80 outputs: two whole 32-column pairs and a 16-column rest
    q, scale, off = blocks(n, width, offset)
    x = activations(rows, width, dtype)
    ours = kernel.linear(x, kernel.pack(q, scale, off))
    reference = kernel.reference_linear(x, q, scale, off)
    assert ours.dtype == dtype and ours.shape == (rows, n)
    if dtype == torch.float32:
        tolerance = 1e-6 * reference.abs().amax(dim=1, keepdim=True) + 1e-30
    else:  # bfloat16 output: its rounding, at most half a unit in the 8th bit
        tolerance = reference.abs() * 2.0**-8 + 1e-30
    assert bool(((ours.to(torch.float64) - reference).abs() <= tolerance).all())


def test_each_row_is_the_same_alone_or_in_a_batch():
    q, scale, off = blocks(64, 96, True)
    packed = kernel.pack(q, scale, off)
    x = activations(11, 96, torch.float32)
    together = kernel.linear(x, packed)
    assert torch.equal(together, torch.cat([kernel.linear(x[i : i + 1], packed) for i in range(11)]))


def test_a_non_finite_block_makes_its_rows_outputs_nan_and_no_other():
    q, scale, off = blocks(32, 64, False)
    x = activations(4, 64, torch.float32)
    x[1, 40] = float("nan")
    x[3, 3] = float("inf")
    ours = kernel.linear(x, kernel.pack(q, scale, off))
    assert ours[1].isnan().all() and ours[3].isnan().all()
    assert torch.isfinite(ours[0]).all() and torch.isfinite(ours[2]).all()
    assert kernel.reference_linear(x, q, scale, off)[[1, 3]].isnan().all()


def test_no_rows_and_wrong_layouts():
    q, scale, off = blocks(32, 64, True)
    packed = kernel.pack(q, scale, off)
    assert kernel.linear(torch.zeros(0, 64), packed).shape == (0, 32)
    with pytest.raises(ValueError, match="64 columns"):
        kernel.linear(torch.zeros(2, 96), packed)
    with pytest.raises(ValueError, match="whole blocks"):
        kernel.quantize_activations(torch.zeros(2, 40))
    with pytest.raises(ValueError, match="multiple of 32"):
        kernel.pack(torch.zeros(4, 40, dtype=torch.int8), torch.zeros(4, 1), None)
    with pytest.raises(ValueError, match="scales"):
        kernel.pack(q, scale[:, :1], None)


def test_dequantize_is_scale_times_q_plus_offset():
    q, scale, off = blocks(4, 64, True)
    w = kernel.dequantize(q, scale, off, torch.float32)
    assert float(w[2, 40]) == pytest.approx(float(q[2, 40]) * float(scale[2, 1]) + float(off[2, 1]), rel=1e-6)
