"""C7: `distributed_executor_backend="pkg.mod:Executor"`: checked in the config-hooks phase (the
frontend, before anything is spawned), built by the engine core, in-process and in its own process."""

from __future__ import annotations

import itertools
import os
import sys

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.config.engine import EngineConfig
from asyncengine.errors import ConfigError
from asyncengine.plugin_runtime.config_hooks import HOOK_READERS, hooks_checked, load_hook
from asyncengine.cli.reports.timeline import plan_start
from asyncengine.plugins_api import UniExecutor

EXECUTORS_MODULE = '''
import json
import os
from pathlib import Path

from asyncengine.plugins_api import UniExecutor, current_process_role

RECORD = Path(__file__).with_suffix(".jsonl")


class RecordingExecutor(UniExecutor):
    """The uni executor, recording where the engine core built it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with RECORD.open("a") as out:
            out.write(json.dumps({"pid": os.getpid(), "role": current_process_role()}) + "\\n")


class NotAnExecutor:
    pass
'''

_names = (f"ae_test_executors_{n}" for n in itertools.count())


@pytest.fixture
def executors(tmp_path, monkeypatch):
    """A fresh module (unique name), importable here and in an engine-core process."""
    name = next(_names)
    (tmp_path / f"{name}.py").write_text(EXECUTORS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    yield name
    sys.modules.pop(name, None)


def records(name: str) -> list[dict]:
    import json

    path = sys.modules[name].RECORD if name in sys.modules else None
    if path is None:
        import importlib

        path = importlib.import_module(name).RECORD
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_option_takes_a_class_path_and_is_read_in_the_engine_core(executors):
    assert EngineConfig(distributed_executor_backend=f"{executors}:RecordingExecutor").executor_backend.endswith(
        ":RecordingExecutor")
    with pytest.raises(ConfigError, match="'uni' .*'mp' .*'pkg.mod:Class'"):
        EngineConfig(distributed_executor_backend="nccl")
    assert HOOK_READERS["distributed_executor_backend"] == ("engine core",)
    config = EngineConfig(distributed_executor_backend=f"{executors}:RecordingExecutor")
    assert ("distributed_executor_backend", f"{executors}:RecordingExecutor") in hooks_checked(config, {"frontend"})
    assert hooks_checked(config, {"worker"}) == []
    assert issubclass(load_hook("distributed_executor_backend", f"{executors}:RecordingExecutor"), UniExecutor)


def test_an_executor_that_is_not_an_executor_is_an_error_naming_the_option_and_value(executors):
    with pytest.raises(ConfigError) as caught:
        load_hook("distributed_executor_backend", f"{executors}:NotAnExecutor")
    assert str(caught.value) == (
        f"distributed_executor_backend: {executors}:NotAnExecutor is <class '{executors}.NotAnExecutor'>, not an "
        "Executor: subclass asyncengine.plugins_api.Executor (or UniExecutor / MultiprocExecutor)")
    assert caught.value.field == "distributed_executor_backend"


def test_a_uni_subclass_makes_the_engine_core_play_the_worker_role_in_the_plan(executors):
    plans = plan_start(EngineConfig(distributed_executor_backend=f"{executors}:RecordingExecutor",
                                    in_process=False))
    assert len(plans) == 2  # frontend and engine core (its worker thread): no worker process


def test_the_plan_refuses_an_executor_path_that_does_not_import_instead_of_guessing_its_placement():
    # Where the worker runs depends on the class (a UniExecutor subclass keeps it in the engine core),
    # so a path that does not import cannot be placed: the plan says so, naming the option.
    with pytest.raises(ConfigError, match="distributed_executor_backend: importing 'no_such_module_here' failed"):
        plan_start(EngineConfig(distributed_executor_backend="no_such_module_here:Executor", in_process=False))


@pytest.mark.parametrize("in_process", [True, False])
def test_a_not_executor_fails_before_anything_is_spawned(executors, tiny_model, in_process):
    with pytest.raises(ConfigError, match=rf"distributed_executor_backend: {executors}:NotAnExecutor is .*not an "
                                          "Executor"):
        LLM(str(tiny_model("llama").path), distributed_executor_backend=f"{executors}:NotAnExecutor",
            in_process=in_process, skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=2**20)
    assert records(executors) == []


@pytest.mark.parametrize("in_process", [True, False])
def test_the_engine_core_builds_and_uses_the_executor(executors, tiny_model, in_process):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_model("llama").path), distributed_executor_backend=f"{executors}:RecordingExecutor",
             in_process=in_process, skip_tokenizer_init=True, max_model_len=128,
             kv_cache_memory_bytes=2**20) as llm:
        (output,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)
        assert len(output.outputs[0].token_ids) == 4
    (record,) = records(executors)
    if in_process:
        assert record == {"pid": os.getpid(), "role": "frontend"}
    else:
        assert record["pid"] != os.getpid() and record["role"] == "engine core"
