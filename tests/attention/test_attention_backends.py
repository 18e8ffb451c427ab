"""Attention backends (R3): the registry, the platform's choice resolved through it per layer, the
`attention_backend` option, errors that name what is wrong, and the choice in the start-up report.

The plugin distribution end to end (a worker process, the manifest check): tests/e2e/test_attention_backend_plugin.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncengine.interfaces.attention import AttentionBackend
from asyncengine.interfaces.attention import TORCH_PAGED, TRITON_PAGED, AttentionBackendRegistry
from asyncengine.attention.registry import register_attention_backend
from asyncengine.attention.selector import select_attention_backends
from asyncengine.attention.torch_paged import TorchPagedBackend
from asyncengine.errors import ConfigError, StartupError
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.platforms.cuda import CudaPlatform
from asyncengine.interfaces.platform import Platform
from asyncengine.plugin_runtime.records import current_process_role
from asyncengine.interfaces.registry import BUILT_IN, RegistrationError

OPTIONS = dict(skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20)
COUNTING = "support.attention_backends:CountingBackend"


class Mine(AttentionBackend):
    def forward(self, query, key, value, kv_cache, metadata):
        return query


class Other(AttentionBackend):
    pass


def layers(*head_dims: int):
    return [SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=d, scale=d**-0.5) for d in head_dims]


def test_the_built_ins_register_in_code_and_only_the_cuda_platform_chooses_triton():
    assert AttentionBackendRegistry.owners()[TORCH_PAGED] == BUILT_IN
    assert AttentionBackendRegistry.owners()[TRITON_PAGED] == BUILT_IN
    assert AttentionBackendRegistry.backend_class(TORCH_PAGED) is TorchPagedBackend
    # The Triton backend stays a lazy path: resolving the registry imports no triton.
    assert AttentionBackendRegistry.get(TRITON_PAGED).implementation == \
        "asyncengine.attention.triton_paged:TritonPagedBackend"
    for platform in (Platform, CpuPlatform):
        for block_size in (16, 12):
            assert platform.get_attn_backend_cls(64, "float32", block_size) == TORCH_PAGED
    assert CudaPlatform.get_attn_backend_cls(64, "bfloat16", 16) == TRITON_PAGED  # triton is a dependency
    assert CudaPlatform.get_attn_backend_cls(64, "bfloat16", 12) == TORCH_PAGED  # the kernel needs 2**k slots


def test_registration_is_idempotent_and_a_different_class_needs_override(fresh_registry):
    register_attention_backend("MINE", Mine)
    register_attention_backend("MINE", f"{__name__}:Mine")  # the same class by path: a no-op
    with pytest.raises(RegistrationError, match=r"attention backend 'MINE' is already registered to .*:Mine "
                                                r"\(by the calling script\); the calling script tried to register "
                                                r".*:Other: pass override=True"):
        register_attention_backend("MINE", Other)
    register_attention_backend("MINE", Other, override=True)
    assert fresh_registry.backend_class("MINE") is Other

    @register_attention_backend("DECORATED")
    class Decorated(Mine):
        pass

    assert fresh_registry.backend_class("DECORATED") is Decorated
    with pytest.raises(RegistrationError, match=r"'TORCH_PAGED' is already registered .* \(by built-in\)"):
        register_attention_backend(TORCH_PAGED, Mine)


def test_an_unknown_name_lists_the_registered_backends(fresh_registry):
    register_attention_backend("MINE", Mine)
    with pytest.raises(ConfigError) as caught:
        fresh_registry.backend_class("FLASH_ATTN", chosen_by="platform cpu")
    assert str(caught.value).startswith("attention backend 'FLASH_ATTN' (chosen by platform cpu) is not registered; "
                                        "registered: MINE, TORCH_PAGED, TRITON_PAGED (a plugin adds one with "
                                        "register_attention_backend")


def test_a_path_resolves_and_what_is_no_backend_is_named(fresh_registry):
    assert fresh_registry.backend_class(COUNTING).__name__ == "CountingBackend"  # a path needs no registration
    register_attention_backend("WRONG", "support.attention_backends:NotABackend")
    with pytest.raises(ConfigError, match=r"attention backend 'WRONG' is <class .*NotABackend'> \(registered by "
                                          r"the calling script\), not an AttentionBackend subclass"):
        fresh_registry.backend_class("WRONG")
    register_attention_backend("MISSING", "no_such_module_here:Backend")
    with pytest.raises(StartupError, match="attention backend 'MISSING': importing 'no_such_module_here' failed"):
        fresh_registry.backend_class("MISSING")


class CountingPlatform(CpuPlatform):
    device_name = "counting"
    asked: list[tuple] = []
    answers: dict[int, object] = {}

    @classmethod
    def get_attn_backend_cls(cls, head_dim, dtype, block_size):
        cls.asked.append((head_dim, dtype, block_size))
        return cls.answers.get(head_dim, TORCH_PAGED)


def test_the_platform_is_asked_once_per_layer_shape_and_each_layer_gets_its_own_instance(fresh_registry):
    register_attention_backend("MINE", Mine)
    CountingPlatform.asked, CountingPlatform.answers = [], {32: "MINE"}
    choice = select_attention_backends(CountingPlatform, layers(64, 64, 32, 32, 64), "float32", 16)
    assert CountingPlatform.asked == [(64, "float32", 16), (32, "float32", 16)]
    assert choice.names == [TORCH_PAGED, TORCH_PAGED, "MINE", "MINE", TORCH_PAGED]
    assert [type(b) for b in choice.backends] == [TorchPagedBackend] * 2 + [Mine] * 2 + [TorchPagedBackend]
    assert len({id(b) for b in choice.backends}) == 5
    assert (choice.backends[2].num_heads, choice.backends[2].num_kv_heads, choice.backends[2].head_dim,
            choice.backends[2].scale) == (4, 2, 32, 32**-0.5)
    assert choice.summary() == ("layers 0-1: TORCH_PAGED; layers 2-3: MINE; layer 4: TORCH_PAGED (chosen by "
                                "platform counting; TORCH_PAGED: registered by built-in; MINE: registered by the "
                                "calling script)")


def test_the_option_wins_over_the_platform_and_the_summary_says_so(fresh_registry):
    register_attention_backend("MINE", Mine)
    CountingPlatform.asked, CountingPlatform.answers = [], {}
    choice = select_attention_backends(CountingPlatform, layers(64, 64), "float32", 16, option="MINE")
    assert CountingPlatform.asked == []
    assert choice.summary() == ("all 2 layers: MINE (chosen by the attention_backend option; registered by the "
                                "calling script)")
    with pytest.raises(ConfigError) as caught:
        select_attention_backends(CountingPlatform, layers(64), "float32", 16, option="NOPE")
    assert caught.value.field == "attention_backend"
    assert ("'NOPE' (chosen by the attention_backend option) is not registered; registered: MINE, TORCH_PAGED, "
            "TRITON_PAGED") in str(caught.value)


def test_a_platform_answer_that_is_no_name_is_an_error_naming_the_platform(fresh_registry):
    CountingPlatform.answers = {64: None}
    with pytest.raises(StartupError, match=r"platform counting: get_attn_backend_cls\(head_dim=64, dtype=float32, "
                                           r"block_size=16\) returned None; it must return a registered attention "
                                           r"backend name \(registered: TORCH_PAGED, TRITON_PAGED\)"):
        select_attention_backends(CountingPlatform, layers(64), "float32", 16)
    CountingPlatform.answers = {64: Mine}  # a class is taken as its path
    assert select_attention_backends(CountingPlatform, layers(64), "float32", 16).names == [f"{__name__}:Mine"]


def test_an_empty_option_is_a_config_error():
    from asyncengine import EngineConfig

    with pytest.raises(ConfigError) as caught:
        EngineConfig(attention_backend=" ")
    assert caught.value.field == "attention_backend"


# -- in an engine (in-process: the worker is a thread of this process) ------------------------------------


def test_a_backend_by_path_runs_every_layer_and_matches_the_built_in(tiny_model):
    from asyncengine import LLM, SamplingParams
    from support.attention_backends import CountingBackend

    model = str(tiny_model("llama").path)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12]}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs, reports = {}, {}
    for backend in (None, COUNTING):
        with LLM(model, attention_backend=backend, **OPTIONS) as llm:
            outputs[backend] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
            reports[backend] = [r for r in llm.engine.startup_report if r.plugin == "attention backend"]
    assert outputs[COUNTING] == outputs[None]
    assert CountingBackend.calls > 0 and CountingBackend.calls % 2 == 0  # two layers, every step
    (built_in,), (counting,) = reports[None], reports[COUNTING]
    # In-process, this process plays every role: the record carries its pid and first role ("frontend").
    assert built_in.phase == "load model" and built_in.role == current_process_role()
    assert built_in.reason == "all 2 layers: TORCH_PAGED (chosen by platform cpu; registered by built-in)"
    assert counting.reason == f"all 2 layers: {COUNTING} (chosen by the attention_backend option; a class path)"


def test_an_unknown_backend_fails_start_up_in_the_frontends_model_phase(tiny_model):
    """Checked in the frontend, before any worker starts or a weight loads (the check moved there from the
    worker's 'load model' phase with vLLM's platform contract: attn_selector_config is resolved up front)."""
    from asyncengine import LLM

    with pytest.raises(ConfigError) as caught:
        LLM(str(tiny_model("llama").path), attention_backend="FLASH_ATTN", **OPTIONS)
    message = str(caught.value)
    assert "the frontend" in message and "failed in start-up phase 'model'" in message
    assert "attention backend 'FLASH_ATTN' (chosen by the attention_backend option) is not registered; " \
           "registered: TORCH_PAGED, TRITON_PAGED" in message


def test_a_layer_needing_what_the_platforms_choice_lacks_gets_torch_paged_and_the_summary_says_so(fresh_registry):
    """MINE declares neither a sliding window nor a soft cap: chosen by the platform, the layers that need one
    run on TORCH_PAGED (which has both, given each layer's values); named by the option, it is an error."""
    register_attention_backend("MINE", Mine)
    CountingPlatform.asked, CountingPlatform.answers = [], {64: "MINE"}
    needs = [SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=64, scale=0.125, sliding_window=window,
                             logits_soft_cap=cap) for window, cap in ((None, None), (512, None), (None, 50.0))]
    choice = select_attention_backends(CountingPlatform, needs, "float32", 16)
    assert choice.names == ["MINE", TORCH_PAGED, TORCH_PAGED]
    assert (choice.backends[1].sliding_window, choice.backends[2].logits_soft_cap) == (512, 50.0)
    assert choice.backends[0].sliding_window is None and choice.backends[0].logits_soft_cap is None
    assert "layer 1 needs a sliding window (512 tokens), which MINE lacks: TORCH_PAGED" in choice.summary()
    assert "layer 2 needs attention logit soft-capping (50.0), which MINE lacks: TORCH_PAGED" in choice.summary()
    with pytest.raises(ConfigError, match="cannot serve attention layer 1: it needs a sliding window") as caught:
        select_attention_backends(CountingPlatform, needs, "float32", 16, option="MINE")
    assert caught.value.field == "attention_backend"
