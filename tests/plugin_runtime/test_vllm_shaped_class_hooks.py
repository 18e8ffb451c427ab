"""Config hooks given class objects, as vLLM's tests pass them (`scheduler_cls=DummyV1Scheduler`).

The class is the vLLM-shaped platform's scheduler (tests/plugins/vllm-shaped-platform, ported by
`plugins port`), imported in this process from its install target. In-process the class itself is
used; for another process the config carries its importable path; a class defined in a function (or
in `__main__`) cannot reach another process, and the frontend says so before it spawns anything.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.config.engine import EngineConfig, config_from_dict
from asyncengine.errors import ConfigError
from asyncengine.plugin_runtime.config_hooks import load_hook
from support.vllm_shaped import environment, port_and_install

OPTIONS = dict(skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=2**20, plugins="")
PROMPTS = [{"prompt_token_ids": [5, 6, 7]}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def shaped_target(tmp_path_factory):
    target, _ = port_and_install("vllm-shaped-platform", tmp_path_factory.mktemp("vllm-shaped"))
    return target


@pytest.fixture
def counting_scheduler(shaped_target, monkeypatch):
    monkeypatch.syspath_prepend(str(shaped_target))
    from vllm_shaped_platform.scheduler import CountingScheduler

    CountingScheduler.steps = 0
    return CountingScheduler


def test_class_objects_become_importable_paths(counting_scheduler):
    from asyncengine.plugins_api import LogitsProcessor, UniExecutor, Worker

    class LocalProcessor(LogitsProcessor):
        pass

    config = config_from_dict({"scheduler_cls": counting_scheduler, "worker_cls": Worker,
                               "distributed_executor_backend": UniExecutor, "logits_processors": [LocalProcessor]})
    assert config.scheduler_cls == "vllm_shaped_platform.scheduler:CountingScheduler"
    assert config.worker_cls == "asyncengine.worker.worker:Worker"
    assert config.distributed_executor_backend == "asyncengine.engine_core.executor:UniExecutor"
    assert load_hook("scheduler_cls", config.scheduler_cls) is counting_scheduler
    # A class defined in a function is found in this process by its (not importable) path.
    (path,) = config.logits_processors
    assert "<locals>" in path and load_hook("logits_processors[0]", path) is LocalProcessor
    # EngineConfig(...) built directly takes classes too; vLLM's dotted form of a path as well.
    assert EngineConfig(scheduler_cls=counting_scheduler).scheduler_cls == config.scheduler_cls
    assert load_hook("scheduler_cls", "vllm_shaped_platform.scheduler.CountingScheduler") is counting_scheduler


def test_an_in_process_engine_uses_the_class_given(counting_scheduler, tiny_model):
    with LLM(str(tiny_model("llama").path), scheduler_cls=counting_scheduler, **OPTIONS) as llm:
        (output,) = llm.generate(PROMPTS, PARAMS)
    assert len(output.outputs[0].token_ids) == 3 and counting_scheduler.steps >= 3


def test_a_class_defined_in_a_function_runs_in_process_and_is_refused_for_another_process(counting_scheduler,
                                                                                         tiny_model):
    class LocalScheduler(counting_scheduler):
        pass

    model = str(tiny_model("llama").path)
    with LLM(model, scheduler_cls=LocalScheduler, **OPTIONS) as llm:
        llm.generate(PROMPTS, PARAMS)
    assert counting_scheduler.steps >= 3
    with pytest.raises(ConfigError) as info:
        LLM(model, scheduler_cls=LocalScheduler, in_process=False, **OPTIONS)
    message = str(info.value)
    assert info.value.field == "scheduler_cls"
    assert "cannot reach the engine core process" in message and "defined inside a function" in message


MAIN_SCRIPT = r"""
import sys
from asyncengine import LLM
from asyncengine.errors import ConfigError
from asyncengine.plugins_api import Scheduler

class MainScheduler(Scheduler):
    pass

try:
    LLM(sys.argv[1], scheduler_cls=MainScheduler, in_process=False, skip_tokenizer_init=True, plugins="")
except ConfigError as exc:
    print(exc)
"""


def test_a_class_in_main_is_refused_for_another_process_saying_why(tiny_model, tmp_path):
    script = tmp_path / "main_script.py"
    script.write_text(MAIN_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tiny_model("llama").path)], capture_output=True,
                            text=True, timeout=120, env=environment())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "scheduler_cls: the class given cannot reach the engine core process" in result.stdout
    assert "MainScheduler is defined in __main__" in result.stdout
