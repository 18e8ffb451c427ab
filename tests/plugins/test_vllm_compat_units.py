"""asyncengine/compat in-process, without an engine: vLLM's EngineArgs reads VLLM_ENABLE_V1_MULTIPROCESSING
as vLLM does; LLMEngine's cumulative outputs are the deltas added up; what step() raises for a dead
engine (the plugin's own exception only when it is here and plugin code raised it); vLLM's older
attention selector raises before the platform phase and resolves a dotted path after it; a model on
PlaceholderAttentionBackend fails at start-up saying why. The engine-level behaviour, ported from
vLLM's tests: tests/plugins/test_vllm_form_tests.py."""

from __future__ import annotations

import pytest

from asyncengine.compat.attention_selector import PlaceholderAttentionBackend, get_attn_backend
from asyncengine.compat.llm_engine import EngineArgs, _accumulate, _as_vllm_raises
from asyncengine.errors import EngineDeadError, StartupError
from asyncengine.interfaces.attention import build_backend, descriptor_implementation
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.plugin_runtime import platform_resolution as resolution
from asyncengine.plugins_api import CpuPlatform


@pytest.mark.parametrize("value, in_process", [("0", True), ("1", False), (None, True)])
def test_engine_args_read_vllms_multiprocessing_switch(monkeypatch, value, in_process):
    if value is None:
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", value)
    config = EngineArgs(model="some/model", enforce_eager=True, max_num_seqs=3).create_engine_config()
    assert (config.in_process, config.enforce_eager, config.max_num_seqs) == (in_process, True, 3)


def test_an_explicit_in_process_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert EngineArgs(model="m", in_process=False).create_engine_config().in_process is False


def _delta(text, ids, finish=None):
    return RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1],
                         outputs=[CompletionOutput(index=0, text=text, token_ids=ids, finish_reason=finish)],
                         finished=finish is not None)


def test_cumulative_outputs_add_the_deltas_up_without_changing_them():
    first, second = _delta("a", [5]), _delta("bc", [6, 7], finish="length")
    cumulative = _accumulate(_accumulate(None, first), second)
    assert (cumulative.outputs[0].text, cumulative.outputs[0].token_ids) == ("abc", [5, 6, 7])
    assert cumulative.finished and cumulative.outputs[0].finish_reason == "length"
    assert (first.outputs[0].text, first.outputs[0].token_ids) == ("a", [5])  # the deltas are not changed


class PluginError(Exception):
    pass


def _raise_from_plugin():
    raise PluginError("the plugin's words")


def test_step_raises_the_plugins_own_exception_when_it_is_here():
    try:
        _raise_from_plugin()  # raised by code outside asyncengine: this test module's function
    except PluginError as exc:
        dead = EngineDeadError.from_exception("the engine core", exc, process="the engine core (in-process)",
                                              phase="step loop")
    raised = _as_vllm_raises(dead)
    assert type(raised) is PluginError and str(raised) == "the plugin's words"
    assert raised.engine_dead_error is dead  # type: ignore[attr-defined]
    assert any("raised by" in note for note in raised.__notes__)


def test_step_raises_the_engine_dead_error_when_the_original_is_elsewhere_or_ours():
    across = EngineDeadError("the engine core died", cause_type="mypkg.MyError", cause_message="boom")
    assert _as_vllm_raises(across) is across  # a multiprocess engine core: only the type's name came back
    try:
        raise StartupError("asyncengine's own")
    except StartupError as exc:
        ours = EngineDeadError.from_exception("the engine core", exc, process="p", phase="q")
    assert _as_vllm_raises(ours) is ours


class DottedPathPlatform(CpuPlatform):
    device_name = "dotted"

    def get_attn_backend_cls(self, selected_backend, head_size, dtype, kv_cache_dtype, block_size, use_v1, use_mla):
        assert (head_size, kv_cache_dtype, block_size) == (16, "fp16", 32)
        return "asyncengine.compat.attention_selector.PlaceholderAttentionBackend"  # vLLM's dotted form


def test_the_older_selector_asks_the_resolved_platform(monkeypatch):
    monkeypatch.setattr(resolution, "_current", None)
    with pytest.raises(StartupError, match="the platform is not resolved yet"):
        get_attn_backend(16, "float16", "fp16", 32, False)
    monkeypatch.setattr(resolution, "_current", DottedPathPlatform)
    backend = get_attn_backend(16, "float16", "fp16", 32, False)
    assert backend is PlaceholderAttentionBackend and backend.get_name() == "NO_ATTENTION"


def test_a_model_on_the_placeholder_backend_fails_at_start_up_saying_why():
    implementation = descriptor_implementation("PLACEHOLDER", PlaceholderAttentionBackend, "a test")
    with pytest.raises(StartupError, match="asyncengine has none"):
        build_backend(implementation, 2, 2, 16, 0.25)
