"""The fused CPU kernels (ops/cpu_fused.py) against their torch references, and the layers' use of them.

Tolerances: the rotary kernel rounds where torch does, so it is bit-equal in both dtypes; the RMSNorm's
sum of squares runs in another order and SiLU's exponential is a polynomial, so in float32 those two
agree to a few ulp (relative 1e-6), and in bfloat16 a rare element may land one bfloat16 step away.
"""

from __future__ import annotations

import pytest
import torch
from support.op_tables import private_op_tables

from asyncengine.models.layers.activation import SiluAndMul, silu_and_mul_native
from asyncengine.models.layers.norm import RMSNorm, rms_norm_native
from asyncengine.models.layers.op_registry import register_op_impl
from asyncengine.models.layers.rotary import RotaryEmbedding, rotary_native
from asyncengine.ops import cpu_fused

pytestmark = pytest.mark.skipif(not cpu_fused.available(torch.float32),
                                reason=f"fused CPU kernels unavailable: {cpu_fused.unavailable_reason()}")

DTYPES = [torch.float32, torch.bfloat16]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    else:  # at most one bfloat16 step (relative 2^-7) on a few elements
        differ = actual != expected
        assert differ.float().mean().item() < 0.01
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 576), (37, 576), (5, 40)])
def test_rms_norm_with_and_without_residual(dtype, rows, width):
    torch.manual_seed(0)
    x, residual = torch.randn(rows, width).to(dtype), torch.randn(rows, width).to(dtype)
    weight = (1 + 0.1 * torch.randn(width)).to(dtype)
    assert_close(cpu_fused.rms_norm(x, weight, 1e-5), rms_norm_native(x, weight, 1e-5), dtype)
    out, summed = cpu_fused.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(summed, x + residual)
    assert_close(out, rms_norm_native(x + residual, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_heads_and_strided_rows(dtype):
    """Qwen3's per-head norm (a 3-D input) and a row-strided view."""
    torch.manual_seed(1)
    heads = torch.randn(4, 3, 64).to(dtype)
    weight = torch.randn(64).to(dtype)
    assert_close(cpu_fused.rms_norm(heads, weight, 1e-6), rms_norm_native(heads, weight, 1e-6), dtype)
    wide = torch.randn(6, 100).to(dtype)
    view = wide[:, 10:74]
    assert cpu_fused.rms_norm_supported(view, weight)
    assert_close(cpu_fused.rms_norm(view, weight, 1e-6), rms_norm_native(view, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 1536), (33, 1536), (3, 24)])
def test_silu_and_mul(dtype, rows, d):
    torch.manual_seed(2)
    x = (4 * torch.randn(rows, 2 * d)).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and signed zero
    assert_close(cpu_fused.silu_and_mul(x), silu_and_mul_native(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_bit_equal_on_qkv_views(dtype):
    """Query and key as the model passes them: strided views of the fused QKV output; not modified."""
    torch.manual_seed(3)
    tokens = 19
    qkv = torch.randn(tokens, 960).to(dtype)
    query, key = qkv[:, :576].view(tokens, 9, 64), qkv[:, 576:768].view(tokens, 3, 64)
    before = qkv.clone()
    rotary = RotaryEmbedding(64, 512, {"rope_theta": 10000.0, "rope_type": "default"})
    cos, sin = rotary.lookup(torch.randint(0, 512, (tokens,)), dtype)
    assert cpu_fused.rotary_supported(query, key, cos, sin)
    q, k = cpu_fused.rotary(query, key, cos, sin)
    q_ref, k_ref = rotary_native(query, key, cos, sin)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(qkv, before)


def test_unsupported_layouts_are_refused():
    x = torch.randn(4, 8)
    assert not cpu_fused.rms_norm_supported(x.t(), torch.ones(4))  # columns, not rows
    assert not cpu_fused.rms_norm_supported(x, torch.ones(8, dtype=torch.bfloat16))  # mixed dtypes
    assert not cpu_fused.silu_and_mul_supported(torch.randn(3, 5))  # odd width
    assert not cpu_fused.rms_norm_supported(x.half(), torch.ones(8).half())


# --- the layers: the fused kernel runs only where nothing else was chosen ---------------------------------


@pytest.fixture
def cpu_tables(monkeypatch):
    """Private copies of the op tables, on the CPU platform."""
    private_op_tables(monkeypatch)


def test_layers_run_the_fused_kernels_on_cpu(monkeypatch, cpu_tables):
    calls = []
    for name in ("rms_norm", "silu_and_mul", "rotary"):
        real = getattr(cpu_fused, name)
        monkeypatch.setattr(cpu_fused, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    norm = RMSNorm(64, 1e-6, dtype=torch.float32)
    x = torch.randn(3, 64)
    out, summed = norm(x, x)
    torch.testing.assert_close(out, rms_norm_native(x + x, norm.weight, 1e-6), rtol=1e-6, atol=1e-6)
    SiluAndMul()(x)
    rotary = RotaryEmbedding(16, 32, {"rope_theta": 10000.0, "rope_type": "default"})
    rotary(torch.randn(3, 4, 16), torch.randn(3, 2, 16), rotary.lookup(torch.tensor([0, 1, 2]), torch.float32))
    assert calls == ["rms_norm", "silu_and_mul", "rotary"]


def test_a_registered_provider_comes_before_the_fused_kernel(cpu_tables):
    seen = []

    def provider(x):
        seen.append(x.shape)
        return silu_and_mul_native(x)

    register_op_impl("silu_and_mul", "test-cpu-fused-provider", provider)
    SiluAndMul()(torch.randn(2, 6))
    assert seen == [torch.Size([2, 6])]


def test_a_subclass_with_its_own_forward_native_runs_it(cpu_tables):
    class Halved(RMSNorm):
        def forward_native(self, x, residual=None):
            return super().forward_native(x, residual) if residual is not None else x / 2

    x = torch.randn(3, 8)
    assert torch.equal(Halved(8, 1e-6, dtype=torch.float32)(x), x / 2)
