"""vLLM's descriptor form of an attention backend (get_name, get_impl_cls, get_builder_cls,
get_kv_cache_shape; no forward): the selector uses get_impl_cls()'s class as the implementation, built
with our four arguments or with vLLM's constructor keywords, and what cannot serve (no forward, vLLM's
forward(layer, ..., attn_metadata), a get_impl_cls that raises) fails start-up saying what to change.
A vLLM-shaped platform choosing one and generating with it: tests/e2e/test_vllm_shaped_platform.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncengine.interfaces.attention import AttentionBackend
from asyncengine.attention.registry import register_attention_backend
from asyncengine.attention.selector import select_attention_backends
from asyncengine.attention.torch_paged import TorchPagedBackend
from asyncengine.errors import StartupError
from asyncengine.platforms.cpu import CpuPlatform


class VllmInitImpl(TorchPagedBackend):
    """An implementation whose constructor is vLLM's AttentionImpl's."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type="decoder"):
        super().__init__(num_heads, num_kv_heads, head_size, scale)
        self.vllm_arguments = (alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap, attn_type)


class Descriptor(AttentionBackend):
    """vLLM's current form: static methods on a subclass of the backend base."""

    @staticmethod
    def get_name():
        return "DESCRIPTOR"

    @staticmethod
    def get_impl_cls():
        return VllmInitImpl

    @staticmethod
    def get_builder_cls():
        return None

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class OldDescriptor:
    """vLLM's older example: a plain class with an instance method, built with no arguments."""

    def get_impl_cls(self):
        return TorchPagedBackend


class NoForwardImpl:
    def __init__(self, *args):
        pass


class VllmForwardImpl:
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        return output


def descriptor_of(impl):
    return type("Desc", (AttentionBackend,), {"get_impl_cls": staticmethod(lambda: impl)})


def raising():
    raise RuntimeError("no kernel for this device")


class AnsweringPlatform(CpuPlatform):
    device_name = "answering"
    answer = "DESCRIPTOR"

    @classmethod
    def get_attn_backend_cls(cls, head_dim, dtype, block_size):
        return cls.answer


LAYERS = [SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25) for _ in range(2)]


def test_the_implementation_of_a_descriptor_is_built_with_vllms_keywords(fresh_registry):
    register_attention_backend("DESCRIPTOR", Descriptor)
    choice = select_attention_backends(AnsweringPlatform, LAYERS, "float32", 16)
    assert [type(backend) for backend in choice.backends] == [VllmInitImpl, VllmInitImpl]
    backend = choice.backends[0]
    assert (backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.scale) == (4, 2, 16, 0.25)
    assert backend.vllm_arguments == (None, None, "auto", None, "decoder")


def test_vllms_older_descriptor_with_an_instance_method_resolves_by_path(fresh_registry, monkeypatch):
    monkeypatch.setattr(AnsweringPlatform, "answer", f"{__name__}.OldDescriptor")  # vLLM's dotted path
    choice = select_attention_backends(AnsweringPlatform, LAYERS, "float32", 16)
    assert [type(backend) for backend in choice.backends] == [TorchPagedBackend] * 2


@pytest.mark.parametrize("impl, expected", [
    (NoForwardImpl, "get_impl_cls() returned test_descriptor_backends:NoForwardImpl, which defines no "
                    "forward(query, key, value, kv_cache, metadata)"),
    (VllmForwardImpl, "whose forward is vLLM's (layer, query, key, value, kv_cache, attn_metadata, output): here it "
                      "is forward(query, key, value, kv_cache, metadata), kv_cache being (key_cache, value_cache)"),
    (object(), "get_impl_cls() returned <object object"),
], ids=["no-forward", "vllm-forward", "not-a-class"])
def test_an_implementation_that_cannot_serve_fails_start_up_saying_what_to_change(fresh_registry, impl, expected):
    register_attention_backend("DESCRIPTOR", descriptor_of(impl))
    with pytest.raises(StartupError) as caught:
        select_attention_backends(AnsweringPlatform, LAYERS, "float32", 16)
    message = str(caught.value)
    assert message.startswith("attention backend 'DESCRIPTOR' (test_descriptor_backends:Desc, registered by the "
                              "calling script, chosen by platform answering) is vLLM's descriptor form"), message
    assert expected in message, message
    assert message.endswith("(docs/porting.md#attention-backends)")


def test_a_get_impl_cls_that_raises_is_named(fresh_registry):
    register_attention_backend("DESCRIPTOR", type("Desc", (AttentionBackend,), {"get_impl_cls": staticmethod(raising)}))
    with pytest.raises(StartupError, match=r"is vLLM's descriptor form; its get_impl_cls\(\) raised RuntimeError: "
                                           r"no kernel for this device"):
        select_attention_backends(AnsweringPlatform, LAYERS, "float32", 16)


def test_a_backend_with_neither_forward_nor_get_impl_cls_still_fails_naming_it(fresh_registry):
    register_attention_backend("DESCRIPTOR", type("Bare", (AttentionBackend,), {}))
    with pytest.raises(StartupError, match=r"attention backend 'DESCRIPTOR' \(test_descriptor_backends:Bare, "
                                           r"registered by the calling script, chosen by platform answering\) "
                                           r"defines no forward"):
        select_attention_backends(AnsweringPlatform, LAYERS, "float32", 16)
