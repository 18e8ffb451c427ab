"""The rope kinds users meet, partial rotary and GPT-J's interleaved rotation, against transformers.

Each table is compared with transformers' own rotary module for the same config (cos and sin per position,
float32, bit-identical where the kind does not depend on the sequence's length); `dynamic` and `longrope`,
whose frequencies transformers recomputes from the longest position of each forward pass, are compared per
position with transformers decoding one token at a time (the sequence then ends at that position), past the
original context too. The rotations are compared with transformers' apply_rotary_pos_emb of Phi-3 (partial)
and GLM-4 (partial and interleaved)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb as glm4_apply
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply

from asyncengine.models.layers import op_registry
from asyncengine.models.layers.rotary import RotaryEmbedding, rope_parameters
from asyncengine.plugin_runtime import platform_resolution as resolution
from asyncengine.platforms.cpu import CpuPlatform
from support.platforms import use_platform

HEAD_DIM, MAX_POSITION = 32, 160
SHORT = [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)]
LONG = [2.0 + 0.15 * i for i in range(HEAD_DIM // 2)]
KINDS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
}


@pytest.fixture(autouse=True)
def cpu_platform(monkeypatch):
    use_platform(monkeypatch, CpuPlatform)
    monkeypatch.setattr(op_registry, "_chains", {})


def llama_config(rope: dict, max_position_embeddings: int = 128) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=2 * HEAD_DIM, num_attention_heads=2, head_dim=HEAD_DIM,
                                    max_position_embeddings=max_position_embeddings, rope_parameters=dict(rope))


def ours(config, max_position: int = MAX_POSITION, **extra) -> RotaryEmbedding:
    return RotaryEmbedding(HEAD_DIM, max_position, {**rope_parameters(config), **extra})


@pytest.mark.parametrize("kind", list(KINDS))
def test_tables_are_transformers_for_the_kinds_that_ignore_length(kind):
    config = llama_config(KINDS[kind])
    reference = LlamaRotaryEmbedding(config)
    positions = torch.arange(MAX_POSITION).unsqueeze(0)
    cos, sin = reference(torch.zeros(1, dtype=torch.float32), positions)
    layer = ours(config)
    assert torch.equal(layer.cos_table, cos[0]) and torch.equal(layer.sin_table, sin[0])


def decoded_one_at_a_time(reference: torch.nn.Module, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin for each position, the sequence ending there (how it rotates a decoded token)."""
    rows = [reference(torch.zeros(1, dtype=torch.float32), torch.tensor([[p]])) for p in positions]
    return torch.cat([cos[0] for cos, _ in rows]), torch.cat([sin[0] for _, sin in rows])


def test_dynamic_ntk_is_unscaled_up_to_the_trained_length_and_scaled_per_position_past_it():
    config = llama_config({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, max_position_embeddings=64)
    layer = ours(config)
    cos, sin = decoded_one_at_a_time(LlamaRotaryEmbedding(config), range(MAX_POSITION))
    unscaled = ours(llama_config(KINDS["default"]))
    assert torch.equal(layer.cos_table[:64], unscaled.cos_table[:64])
    # Past the trained length the per-position bases come out of a vectorised pow: their inverse frequencies may
    # differ from transformers' scalar one by an ulp, which is an ulp of the angle (8e-6 near 100 radians).
    torch.testing.assert_close(layer.cos_table, cos, rtol=0, atol=1e-5)
    torch.testing.assert_close(layer.sin_table, sin, rtol=0, atol=1e-5)
    assert not torch.allclose(layer.cos_table[100:], unscaled.cos_table[100:])  # the scaling did something


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_short_factors_inside_the_original_context_and_long_past_it(partial):
    config = transformers.Phi3Config(
        hidden_size=2 * HEAD_DIM, num_attention_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=32, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                         "short_factor": SHORT[: int(HEAD_DIM * partial) // 2],
                         "long_factor": LONG[: int(HEAD_DIM * partial) // 2]})
    layer = ours(config)
    assert layer.rotary_dim == int(HEAD_DIM * partial)
    cos, sin = decoded_one_at_a_time(Phi3RotaryEmbedding(config), range(MAX_POSITION))
    assert torch.equal(layer.cos_table, cos) and torch.equal(layer.sin_table, sin)
    short_only = ours(config, long_factor=config.rope_parameters["short_factor"])
    assert torch.equal(layer.cos_table[:32], short_only.cos_table[:32])
    assert not torch.allclose(layer.cos_table[32:], short_only.cos_table[32:])  # the long factors past 32


def test_partial_rotary_rotates_the_leading_dimensions_as_phi3_does():
    config = transformers.Phi3Config(hidden_size=2 * HEAD_DIM, num_attention_heads=2, max_position_embeddings=128,
                                     pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                      "partial_rotary_factor": 0.75})
    layer = ours(config)
    assert layer.rotary_dim == 24
    positions = torch.tensor([0, 3, 17, 90])
    query, key = torch.randn(4, 3, HEAD_DIM), torch.randn(4, 1, HEAD_DIM)
    cos, sin = Phi3RotaryEmbedding(config)(query, positions.unsqueeze(0))
    expected_q, expected_k = phi3_apply(query.transpose(0, 1).unsqueeze(0), key.transpose(0, 1).unsqueeze(0), cos, sin)
    for forward in (layer.forward_native, layer.forward_cpu):  # the torch path and the fused kernel's
        got_q, got_k = forward(query, key, layer.lookup(positions, torch.float32))
        assert torch.equal(got_q, expected_q[0].transpose(0, 1)) and torch.equal(got_k, expected_k[0].transpose(0, 1))


def test_glm_rotates_interleaved_pairs_of_half_the_head():
    config = transformers.Glm4Config(hidden_size=2 * HEAD_DIM, num_attention_heads=2, head_dim=HEAD_DIM,
                                     max_position_embeddings=128, pad_token_id=0)
    layer = ours(config, is_neox_style=False)
    assert layer.rotary_dim == HEAD_DIM // 2 and not layer.is_neox_style
    positions = torch.tensor([1, 5, 64])
    query, key = torch.randn(3, 2, HEAD_DIM), torch.randn(3, 2, HEAD_DIM)
    reference = transformers.models.glm4.modeling_glm4.Glm4RotaryEmbedding(config)
    cos, sin = reference(query, positions.unsqueeze(0))
    expected_q, expected_k = glm4_apply(query.transpose(0, 1).unsqueeze(0), key.transpose(0, 1).unsqueeze(0), cos, sin)
    got_q, got_k = layer(query, key, layer.lookup(positions, torch.float32))
    assert torch.equal(got_q, expected_q[0].transpose(0, 1)) and torch.equal(got_k, expected_k[0].transpose(0, 1))


def test_gemma3_local_and_global_bases_per_layer_type():
    config = transformers.Gemma3TextConfig(hidden_size=64, num_attention_heads=2, head_dim=HEAD_DIM,
                                           num_hidden_layers=2, sliding_window_pattern=2, rope_parameters={
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                                  "factor": 8.0}})
    from types import SimpleNamespace

    as_dict = SimpleNamespace(**config.to_dict())  # what the worker builds from (ModelConfig.hf_config)
    local, global_ = rope_parameters(as_dict, "sliding_attention"), rope_parameters(as_dict, "full_attention")
    assert (local["rope_theta"], local["rope_type"]) == (10000.0, "default")
    assert (global_["rope_theta"], global_["rope_type"], global_["factor"]) == (1e6, "linear", 8.0)
    reference = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(config)
    positions = torch.arange(MAX_POSITION).unsqueeze(0)
    for layer_type, params in (("sliding_attention", local), ("full_attention", global_)):
        cos, _ = reference(torch.zeros(1), positions, layer_type)
        assert torch.equal(RotaryEmbedding(HEAD_DIM, MAX_POSITION, params).cos_table, cos[0])
