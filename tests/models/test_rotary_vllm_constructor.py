"""The rotary op's constructor takes vLLM's arguments `(head_size, rotary_dim, max_position_embeddings,
base, is_neox_style, dtype)` as well as ours `(head_dim, max_position, params)`: vLLM's own platform-plugin
test builds `RotaryEmbedding(16, 16, 16, 16, True, torch.float16)` and expects its out-of-tree replacement;
a replacement whose __init__ declares vLLM's arguments is built by our model (which passes ours) with
vLLM's, and the model's rope scaling still reaches the tables. What vLLM's arguments ask for partial rotary
or GPT-J's rotation, those are built. Registrations are process-wide, so every
test runs on copies of the tables."""

from __future__ import annotations

import pytest
import torch

from asyncengine.interfaces.custom_op_registry import OOT_PREFIX
from asyncengine.models.layers import op_registry
from asyncengine.interfaces.custom_op_registry import CustomOpRegistry, OpProviderRegistry
from asyncengine.models.layers.rotary import RotaryEmbedding
from asyncengine.plugin_runtime import platform_resolution as resolution
from asyncengine.platforms.cpu import CpuPlatform
from support.platforms import use_platform

LLAMA3 = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.fixture(autouse=True)
def tables(monkeypatch):
    for registry in (CustomOpRegistry, OpProviderRegistry):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    monkeypatch.setattr(op_registry, "_chains", {})
    use_platform(monkeypatch, CpuPlatform)


def test_vllms_positional_constructor_builds_the_replacement_as_vllms_test_expects():
    @RotaryEmbedding.register_oot
    class DummyRotaryEmbedding(RotaryEmbedding):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.addition_config = True

    layer = RotaryEmbedding(16, 16, 16, 16, True, torch.float16)
    assert type(layer).__name__ == "DummyRotaryEmbedding" and layer.addition_config
    assert (layer.head_size, layer.rotary_dim, layer.max_position_embeddings, layer.base, layer.dtype) == \
        (16, 16, 16, 16.0, torch.float16)
    ours = RotaryEmbedding(16, 16, {"rope_theta": 16.0, "rope_type": "default"})
    assert torch.equal(layer.cos_table, ours.cos_table) and torch.equal(layer.sin_table, ours.sin_table)
    assert layer.cos_sin_cache.shape == (16, 16)  # vLLM's [max_position, rotary_dim]


def test_a_replacement_declaring_vllms_arguments_is_built_from_ours_and_keeps_the_scaling():
    seen = {}

    @RotaryEmbedding.register_oot
    class VllmShapedRotary(RotaryEmbedding):
        def __init__(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype):
            seen.update(head_size=head_size, rotary_dim=rotary_dim, max_position=max_position_embeddings, base=base,
                        is_neox_style=is_neox_style, dtype=dtype)
            super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    layer = RotaryEmbedding(8, 64, LLAMA3)  # the model's call
    assert type(layer) is VllmShapedRotary
    assert seen == {"head_size": 8, "rotary_dim": 8, "max_position": 64, "base": 500000.0, "is_neox_style": True,
                    "dtype": torch.get_default_dtype()}
    CustomOpRegistry._entries.pop(OOT_PREFIX + "RotaryEmbedding")  # the replacement gone: the in-tree op
    in_tree = RotaryEmbedding(8, 64, LLAMA3)
    assert type(in_tree) is RotaryEmbedding
    assert torch.equal(layer.cos_table, in_tree.cos_table)  # llama3 scaling kept, though vLLM's has only base


def test_vllms_partial_and_gptj_arguments_build_those_rotations():
    partial = RotaryEmbedding(16, 8, 16, 10000.0, True, torch.float32)
    assert (partial.head_size, partial.rotary_dim, partial.is_neox_style) == (16, 8, True)
    assert partial.cos_table.shape == (16, 8)
    gptj = RotaryEmbedding(16, 16, 16, 10000.0, False, torch.float32)
    assert not gptj.is_neox_style and torch.equal(gptj.cos_table[:, 0], gptj.cos_table[:, 1])  # pairs share angles
    ours = RotaryEmbedding(16, 16, {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5})
    assert torch.equal(partial.cos_table, ours.cos_table)


def test_neither_form_is_a_type_error_giving_both():
    with pytest.raises(TypeError, match=r"RotaryEmbedding takes \(head_dim, max_position, params\), or vLLM's "
                                        r"\(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, "
                                        r"dtype\)"):
        RotaryEmbedding(16, 16)
