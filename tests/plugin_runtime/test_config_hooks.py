"""The config hooks `scheduler_cls` and `worker_extension_cls`: their checks, the worker's RPC lookup,
the timeline plan, and an in-process engine (uni executor) using both.

The multiprocess end-to-end test with the first-party distributions is tests/e2e/test_config_hooks_e2e.py.
"""

from __future__ import annotations

import itertools
import sys

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.config.engine import EngineConfig
from asyncengine.errors import ConfigError, WorkerError
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.plugin_runtime.config_hooks import load_hook
from asyncengine.cli.reports.timeline import plan_start
from asyncengine.worker.extension import build_extension, rpc_method
from asyncengine.worker.worker import Worker

HOOKS_MODULE = '''
from asyncengine.plugins_api import Scheduler

INSTANCES = []


class CountingScheduler(Scheduler):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.num_steps = 0
        INSTANCES.append(self)

    def schedule(self):
        self.num_steps += 1
        return super().schedule()


class NotAScheduler:
    pass


class PingExtension:
    def __init__(self, worker):
        self._worker = worker

    def ping(self, value):
        return {"pong": value, "rank": self._worker.rank}

    def _private(self):
        return "never reachable"


class ClashesWithAnAttribute:
    def __init__(self, worker):
        pass

    def rank(self):  # the worker's `rank` is an attribute (declared on the Worker class)
        return -1


class TakesNoWorker:
    def ping(self):
        return "pong"
'''

_names = itertools.count()


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    """A fresh module (unique name: modules stay imported in this process) with classes for each hook."""
    name = f"ae_test_hooks_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(HOOKS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_both_options_are_accepted_and_so_is_worker_cls(hooks):
    config = EngineConfig(scheduler_cls=f"{hooks}:CountingScheduler", worker_extension_cls=f"{hooks}:PingExtension")
    assert config.scheduler_cls.endswith(":CountingScheduler")
    assert EngineConfig(worker_cls="x.y:Worker").worker_cls == "x.y:Worker"  # C2: tests/plugin_runtime/test_worker_cls.py
    with pytest.raises(ConfigError) as info:
        EngineConfig(worker_cls="Worker")  # no module part ("x.y" is vLLM's dotted form of x:y, accepted)
    assert info.value.field == "worker_cls"


def test_a_scheduler_class_must_import_and_subclass_scheduler(hooks):
    assert load_hook("scheduler_cls", f"{hooks}:CountingScheduler").__name__ == "CountingScheduler"
    cases = {
        "ae_no_such_module:Scheduler": "scheduler_cls: importing 'ae_no_such_module' failed: No module named "
                                       "'ae_no_such_module'",
        f"{hooks}:Missing": f"scheduler_cls: module '{hooks}' has no attribute 'Missing'",
        "no_colon": "scheduler_cls: 'no_colon' is not of the form 'package.module:Class'",
        f"{hooks}:INSTANCES": f"scheduler_cls: {hooks}:INSTANCES is [], not a class; name a subclass of "
                              "asyncengine.plugins_api.Scheduler",
        f"{hooks}:NotAScheduler": f"scheduler_cls: {hooks}:NotAScheduler is not a subclass of "
                                  "asyncengine.engine_core.scheduler:Scheduler; subclass",
    }
    for path, message in cases.items():
        with pytest.raises(ConfigError) as info:
            load_hook("scheduler_cls", path)
        assert str(info.value).startswith(message), str(info.value)
        assert info.value.field == "scheduler_cls"


def test_a_worker_extension_must_be_a_class_built_with_the_worker_and_must_not_clash(hooks):
    assert load_hook("worker_extension_cls", f"{hooks}:PingExtension").__name__ == "PingExtension"
    cases = {
        f"{hooks}:INSTANCES": "is [], not a class; name a class that takes the worker: Class(worker)",
        f"{hooks}:ClashesWithAnAttribute": (
            f"defines public method 'rank', which the worker class asyncengine.worker.worker:Worker already has: "
            f"collective_rpc('rank') finds the worker's first, so {hooks}:ClashesWithAnAttribute.rank would never "
            "run; rename it in the extension"),
        f"{hooks}:TakesNoWorker": "cannot be built as TakesNoWorker(worker): too many positional arguments; "
                                  "its constructor takes the worker",
    }
    for path, problem in cases.items():
        with pytest.raises(ConfigError) as info:
            load_hook("worker_extension_cls", path)
        assert str(info.value) == f"worker_extension_cls: {path} {problem}"
        assert info.value.field == "worker_extension_cls"


def test_rpc_finds_the_worker_first_then_the_extension(hooks):
    worker = Worker(EngineConfig(), None, CpuPlatform)
    with pytest.raises(WorkerError, match="^the worker has no method 'ping'$"):
        rpc_method(worker, "ping")
    worker.extension = build_extension(worker, f"{hooks}:PingExtension")
    assert rpc_method(worker, "ping")(7) == {"pong": 7, "rank": 0}
    assert rpc_method(worker, "describe").__self__ is worker
    with pytest.raises(WorkerError, match=f"^neither the worker nor its extension {hooks}:PingExtension has a "
                                          "method '_private'$"):
        rpc_method(worker, "_private")
    with pytest.raises(WorkerError, match="'rank' is an attribute of asyncengine.worker.worker:Worker, not a method"):
        rpc_method(worker, "rank")


def test_the_timeline_lists_each_hook_where_it_is_checked():
    hooks = dict(scheduler_cls="pkg.mod:MyScheduler", worker_extension_cls="pkg.mod:MyExtension")

    def checked(**options) -> dict[str, list[str]]:
        return {process.role: phase.details for process in plan_start(EngineConfig(**hooks, **options))
                for phase in process.phases if phase.name == "config hooks"}

    scheduler = "scheduler_cls=pkg.mod:MyScheduler (import; a Scheduler subclass or a SchedulerInterface implementation)"
    extension = ("worker_extension_cls=pkg.mod:MyExtension (import; a class built as Class(worker), no public "
                 "method clashing with the worker's)")
    assert checked(in_process=False, tensor_parallel_size=2) == {
        "frontend": [scheduler, extension], "engine core": [scheduler],
        "worker rank 0": [extension], "worker rank 1": [extension],
    }
    # The engine core with its worker on a thread reads both; in-process, the frontend checks both.
    assert checked(in_process=False) == {"frontend": [scheduler, extension], "engine core": [scheduler, extension]}
    assert checked(in_process=True) == {"frontend": [scheduler, extension]}


def test_an_in_process_engine_uses_both_hooks(hooks, tiny_model):
    options = dict(skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=2**20)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 8, 7, 6]}]
    model = str(tiny_model("llama").path)
    with LLM(model, **options) as llm:
        reference = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    with LLM(model, scheduler_cls=f"{hooks}:CountingScheduler", worker_extension_cls=f"{hooks}:PingExtension",
             **options) as llm:
        assert [output.outputs[0].token_ids for output in llm.generate(prompts, params)] == reference
        assert llm.collective_rpc("ping", [3]) == [{"pong": 3, "rank": 0}]
        with pytest.raises(WorkerError, match=rf"the worker \(a thread of .*\): neither the worker nor its "
                                              rf"extension {hooks}:PingExtension has a method 'nope'"):
            llm.collective_rpc("nope")
    (scheduler,) = sys.modules[hooks].INSTANCES
    assert type(scheduler).__name__ == "CountingScheduler" and scheduler.num_steps >= 6
