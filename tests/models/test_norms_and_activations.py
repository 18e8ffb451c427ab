"""GemmaRMSNorm (the weight applied in float32, before the rounding) and GeluAndMul against transformers' own
modules: Gemma 3's `(1 + w)` norm, OLMo 2's norm, Gemma's `gelu_pytorch_tanh` GeGLU. The torch path is
bit-identical; the fused CPU kernel's float32-weight mode sums its squares in another order (a few ulp in
float32, at most one bfloat16 step on a rare element in bfloat16), as tests/ops/test_cpu_fused.py allows."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from asyncengine.errors import ModelLoadError
from asyncengine.models.layers import op_registry
from asyncengine.models.layers.activation import GeluAndMul, SiluAndMul, gated_activation
from asyncengine.models.layers.norm import GemmaRMSNorm
from asyncengine.ops import cpu_fused
from asyncengine.plugin_runtime import platform_resolution as resolution
from asyncengine.platforms.cpu import CpuPlatform
from support.platforms import use_platform

WIDTH = 96


@pytest.fixture(autouse=True)
def cpu_platform(monkeypatch):
    use_platform(monkeypatch, CpuPlatform)
    monkeypatch.setattr(op_registry, "_chains", {})


def reference_norm(kind: str, dtype: torch.dtype, generator: torch.Generator) -> tuple[torch.nn.Module, GemmaRMSNorm]:
    theirs = Gemma3RMSNorm(WIDTH, eps=1e-6) if kind == "gemma" else Olmo2RMSNorm(WIDTH, eps=1e-6)
    ours = GemmaRMSNorm(WIDTH, 1e-6, dtype=dtype, weight_offset=1.0 if kind == "gemma" else 0.0)
    with torch.no_grad():
        theirs.weight.copy_(0.3 * torch.randn(WIDTH, generator=generator) + (0.0 if kind == "gemma" else 1.0))
        theirs.to(dtype)
        ours.weight.copy_(theirs.weight)
    return theirs, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["gemma", "olmo2"])
def test_norm_is_transformers(kind, dtype):
    generator = torch.Generator().manual_seed(0)
    theirs, ours = reference_norm(kind, dtype, generator)
    x = torch.randn(7, WIDTH, generator=generator).to(dtype)
    residual = torch.randn(7, WIDTH, generator=generator).to(dtype)
    assert torch.equal(ours.forward_native(x), theirs(x))
    normed, summed = ours.forward_native(x, residual)
    assert torch.equal(summed, residual + x) and torch.equal(normed, theirs(residual + x))
    if not cpu_fused.available(dtype):
        pytest.skip(f"fused CPU kernels unavailable: {cpu_fused.unavailable_reason()}")
    fused, fused_sum = ours.forward_cpu(x, residual)
    assert torch.equal(fused_sum, summed)
    if dtype == torch.float32:
        torch.testing.assert_close(fused, normed, rtol=1e-6, atol=1e-6)
    else:
        assert (fused != normed).float().mean().item() < 0.02
        torch.testing.assert_close(fused.float(), normed.float(), rtol=2**-7, atol=1e-5)


def test_norm_weight_change_is_seen():
    """The float32 `offset + w` is cached per weight version: a reload after the first call is used."""
    norm = GemmaRMSNorm(4, 1e-6, dtype=torch.float32)
    x = torch.ones(1, 4)
    first = norm.forward_native(x)
    with torch.no_grad():
        norm.weight.fill_(1.0)  # (1 + 1): twice the output
    assert torch.equal(norm.forward_native(x), 2 * first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_geglu_is_transformers_gelu_pytorch_tanh(dtype):
    x = torch.randn(5, 2 * WIDTH, generator=torch.Generator().manual_seed(1)).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = ACT2FN["gelu_pytorch_tanh"](gate) * up
    assert torch.equal(GeluAndMul(approximate="tanh")(x), expected)
    assert torch.equal(GeluAndMul()(x), ACT2FN["gelu"](gate) * up)


def test_gated_activation_by_config_name():
    assert isinstance(gated_activation("silu"), SiluAndMul)
    geglu = gated_activation("gelu_pytorch_tanh")
    assert isinstance(geglu, GeluAndMul) and geglu.approximate == "tanh"
    with pytest.raises(ModelLoadError, match="hidden activation 'relu2' is not supported"):
        gated_activation("relu2")
