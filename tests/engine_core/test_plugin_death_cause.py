"""A plugin's exception in the engine core reaches the caller as EngineDeadError that keeps what it was.

vLLM's scheduler tests assert the text of the exception a scheduler plugin raises; here the engine
core dies of it, and the EngineDeadError carries its qualified type name, its message and the culprit
(the plugin's code, the process, the phase) -- across the wire as EngineCoreDead/StepResult fields when
the engine core or the worker runs in a process of its own, and in-process as the `__cause__` too.
"""

from __future__ import annotations

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.errors import EngineDeadError

OPTIONS = dict(skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=2**20, plugins="")
PROMPTS = [{"prompt_token_ids": [5, 6, 7]}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

PLUGIN_MODULE = '''
from asyncengine.plugins_api import Scheduler, Worker


class ShapedPluginError(RuntimeError):
    pass


class RaisingScheduler(Scheduler):
    def schedule(self, *args, **kwargs):
        raise ShapedPluginError("the dummy scheduler refuses to schedule")


class RaisingWorker(Worker):
    def execute_model(self, scheduler_output):
        raise ShapedPluginError("the dummy worker refuses to execute")
'''


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """raising_plugins.py, importable here and (through PYTHONPATH) in the processes the engine starts."""
    (tmp_path / "raising_plugins.py").write_text(PLUGIN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    import raising_plugins

    return raising_plugins


def _death(model: str, **options) -> EngineDeadError:
    with LLM(model, **OPTIONS, **options) as llm:
        with pytest.raises(EngineDeadError) as info:
            llm.generate(PROMPTS, PARAMS)
    return info.value


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "engine-core-process"])
def test_a_scheduler_plugin_raising_in_schedule_names_type_message_and_culprit(plugin_module, tiny_model,
                                                                                in_process):
    scheduler = plugin_module.RaisingScheduler if in_process else "raising_plugins:RaisingScheduler"
    dead = _death(str(tiny_model("llama").path), scheduler_cls=scheduler, in_process=in_process)

    assert dead.cause_type == "raising_plugins.ShapedPluginError"
    assert dead.cause_message == "the dummy scheduler refuses to schedule"
    assert "ShapedPluginError: the dummy scheduler refuses to schedule" in str(dead)  # vLLM's tests match by text
    assert dead.culprit is not None
    assert "raising_plugins.RaisingScheduler.schedule" in dead.culprit
    assert "scheduler.schedule()" in dead.culprit  # the phase
    assert ("(in-process)" if in_process else "(pid ") in dead.culprit  # the process
    if in_process:
        assert isinstance(dead.__cause__, plugin_module.ShapedPluginError)
        assert str(dead.__cause__) == "the dummy scheduler refuses to schedule"
    else:  # only the type's name and the text crossed (no pickle)
        assert dead.__cause__ is None


@pytest.mark.parametrize("in_process,backend", [(True, "uni"), (False, "mp")], ids=["thread", "worker-process"])
def test_a_worker_plugin_raising_in_execute_model_names_type_message_and_culprit(plugin_module, tiny_model,
                                                                                 in_process, backend):
    dead = _death(str(tiny_model("llama").path), worker_cls="raising_plugins:RaisingWorker", in_process=in_process,
                  distributed_executor_backend=backend)

    assert dead.cause_type == "raising_plugins.ShapedPluginError"
    assert dead.cause_message == "the dummy worker refuses to execute"
    assert "ShapedPluginError: the dummy worker refuses to execute" in str(dead)
    assert dead.culprit is not None
    assert "raising_plugins.RaisingWorker.execute_model" in dead.culprit
    assert "execute_model" in dead.culprit
    if in_process:
        assert isinstance(dead.__cause__, plugin_module.ShapedPluginError)
    else:
        assert "worker process pid" in dead.culprit


def test_each_later_caller_gets_the_same_cause(plugin_module, tiny_model):
    with LLM(str(tiny_model("llama").path), scheduler_cls=plugin_module.RaisingScheduler, **OPTIONS) as llm:
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS, PARAMS)
        with pytest.raises(EngineDeadError) as again:
            llm.generate(PROMPTS, PARAMS)
    assert again.value.cause_type == "raising_plugins.ShapedPluginError"
    assert "raising_plugins.RaisingScheduler.schedule" in (again.value.culprit or "")
    assert isinstance(again.value.__cause__, plugin_module.ShapedPluginError)
