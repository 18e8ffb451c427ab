"""`scheduler_cls` and `worker_extension_cls` end to end, with the first-party plugin distributions.

A user's script runs in a fresh interpreter with exactly the distributions it needs installed on its
PYTHONPATH (`plugin_env`) and starts a real engine: the engine core in its own process and two
tensor-parallel worker processes, on the tiny Llama. It shows:
- the Scheduler subclass runs in the engine-core process; async scheduling is kept with it (the step
  trace: step N+1 scheduled before step N finished executing, as bench/runtime.py counts "scheduled
  ahead"); greedy outputs are those of the built-in scheduler;
- the worker extension is built in each worker process and `collective_rpc` reaches its method on
  every rank;
- each process checked the hooks its role reads, as `asyncengine plugins timeline` says;
- a scheduler class that is not a Scheduler, and an extension whose method clashes with the worker's,
  fail start-up in the frontend, before anything is spawned, with a message naming what is wrong.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.config.engine import EngineConfig
from asyncengine.plugin_runtime.records import read_trace
from asyncengine.cli.reports.timeline import plan_start
from asyncengine.interfaces.scheduler import SCHEDULER_METHODS

SCHEDULER = "ae_scheduler_example:RecordingScheduler"
EXTENSION = "ae_worker_extension_example:RankInfoExtension"
DISTRIBUTIONS = ("asyncengine-scheduler-example", "asyncengine-worker-extension-example")
NUM_PROMPTS, NUM_TOKENS = 8, 32

SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams
from asyncengine.errors import StartupError, WorkerError

model, hooks, trace_file = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
options = dict(in_process=False, distributed_executor_backend="mp", tensor_parallel_size=2,
               skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20,
               startup_trace=trace_file, **hooks)
prompts = [{"prompt_token_ids": [5 + i, 6, 7 + 2 * i, 8, 9 + 3 * i]} for i in range(%(num_prompts)d)]
result = {"pid": os.getpid()}
try:
    with LLM(model, **options) as llm:
        # The engine core's utilities (as bench/runtime.py calls them on an AsyncEngine), through the
        # event loop the LLM runs its AsyncEngine in.
        def core(method):
            return llm._portal.call(llm.engine.call_engine_core, method)

        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
        core("start_step_trace")
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=%(num_tokens)d, ignore_eos=True))
        result["steps"] = core("stop_step_trace")
        result["tokens"] = [list(output.outputs[0].token_ids) for output in outputs]
        if "worker_extension_cls" in hooks:
            result["ranks"] = llm.collective_rpc("describe_rank")
            result["num_calls"] = llm.collective_rpc("num_calls")
            result["describe"] = llm.collective_rpc("describe")  # the worker's own method still answers
            try:
                llm.collective_rpc("no_such_method")
            except WorkerError as error:
                result["unknown_method"] = str(error)
except StartupError as error:
    result.update(error=type(error).__name__, field=getattr(error, "field", None), message=str(error))
print(json.dumps(result))
""" % {"num_prompts": NUM_PROMPTS, "num_tokens": NUM_TOKENS}

# A module on PYTHONPATH with the wrong kinds of class for each hook.
BAD_HOOKS = '''
class NotAScheduler:
    """Schedules nothing, and is not a subclass of asyncengine's Scheduler."""


class ClashingExtension:
    def __init__(self, worker):
        self.worker = worker

    def load_model(self):  # the worker has load_model: collective_rpc would never reach this one
        return "never"
'''


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def run_script(tmp_path: Path, env: dict[str, str], model: Path, hooks: dict[str, str], name: str) -> tuple[dict, Path]:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    trace_file = tmp_path / f"{name}-trace.json"
    result = subprocess.run([sys.executable, str(script), str(model), json.dumps(hooks), str(trace_file)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), trace_file


def scheduled_ahead(steps: list[list[float]], *, max_tokens: int) -> tuple[int, int]:
    """(decode steps scheduled before the previous step finished executing, decode steps), from StepRecords
    (step, tokens, schedule start/end, execute start/end, update start/end), as bench/runtime.py counts."""
    steps = sorted(steps, key=lambda record: record[0])
    pairs = [(previous, current) for previous, current in zip(steps, steps[1:]) if current[1] <= max_tokens]
    return sum(1 for previous, current in pairs if current[3] <= previous[5]), len(pairs)


def pids_by_role(trace_file: Path) -> dict[str, int]:
    return {record.role: record.pid for record in read_trace(trace_file)}


@pytest.mark.extension_point("C1", "C3", "G4")
def test_both_hooks_run_where_promised_and_keep_async_scheduling(llama, tmp_path, plugin_env):
    record_file = tmp_path / "plugin-record.jsonl"
    env = plugin_env(*DISTRIBUTIONS, AE_PLUGIN_RECORD=str(record_file))
    baseline, _ = run_script(tmp_path, env, llama.path, {}, "baseline")
    assert "error" not in baseline, baseline
    assert not record_file.exists()  # neither hook is used without being named
    hooks = {"scheduler_cls": SCHEDULER, "worker_extension_cls": EXTENSION}
    result, trace_file = run_script(tmp_path, env, llama.path, hooks, "hooks")
    assert "error" not in result, result
    pids = pids_by_role(trace_file)
    assert set(pids) == {"frontend", "engine core", "worker rank 0", "worker rank 1"}
    assert pids["frontend"] == result["pid"] and len(set(pids.values())) == 4
    records = [json.loads(line) for line in record_file.read_text().splitlines()]

    # The scheduler subclass ran in the engine-core process, and only there.
    scheduler_records = [r for r in records if r["plugin"] == "ae_scheduler_example"]
    assert [r["event"] for r in scheduler_records] == ["init", "first schedule"]
    assert {(r["pid"], r["role"]) for r in scheduler_records} == {(pids["engine core"], "engine core")}
    assert scheduler_records[0]["pid"] != result["pid"]

    # Greedy outputs are the built-in scheduler's (the subclass changes no decision).
    assert result["tokens"] == baseline["tokens"]
    assert all(len(tokens) == NUM_TOKENS for tokens in result["tokens"])

    # Async scheduling is kept: for most decode steps, scheduling step N+1 finished before step N
    # finished executing in the workers.
    ahead, decode_steps = scheduled_ahead(result["steps"], max_tokens=NUM_PROMPTS)
    assert decode_steps >= NUM_TOKENS - 2, result["steps"]
    assert ahead / decode_steps >= 0.5, (ahead, decode_steps, scheduled_ahead(baseline["steps"], max_tokens=NUM_PROMPTS))

    # The extension was built once in each worker process and answers collective_rpc on every rank.
    ranks = sorted(result["ranks"], key=lambda answer: answer["rank"])
    assert [answer["rank"] for answer in ranks] == [0, 1]
    assert [answer["role"] for answer in ranks] == ["worker rank 0", "worker rank 1"]
    assert [answer["pid"] for answer in ranks] == [pids["worker rank 0"], pids["worker rank 1"]]
    assert len({answer["pid"] for answer in ranks} | {result["pid"], pids["engine core"]}) == 4
    assert all(answer["parameter_bytes"] > 0 and answer["world_size"] == 2 for answer in ranks)
    assert result["num_calls"] == [1, 1]  # one instance per worker, keeping its state between calls
    assert [answer["pid"] for answer in result["describe"]] == [pids["worker rank 0"], pids["worker rank 1"]]
    assert ("neither the worker nor its extension ae_worker_extension_example:RankInfoExtension has a method "
            "'no_such_method'") in result["unknown_method"]
    extension_inits = sorted((r["role"], r["pid"]) for r in records
                             if r["plugin"] == "ae_worker_extension_example" and r["event"] == "init")
    assert extension_inits == [("worker rank 0", pids["worker rank 0"]), ("worker rank 1", pids["worker rank 1"])]

    # Each process checked the hooks its role reads (the frontend: all, before spawning), as the
    # `plugins timeline` plan for the same settings says.
    checked = {}
    for record in read_trace(trace_file):
        if record.phase == "config hooks" and record.plugin is not None:
            checked.setdefault(record.role, []).append(record.plugin)
    plan = plan_start(EngineConfig(in_process=False, distributed_executor_backend="mp", tensor_parallel_size=2,
                                   **hooks))
    planned = {process.role: [detail.split(" (import")[0] for detail in phase.details]
               for process in plan for phase in process.phases if phase.name == "config hooks"}
    assert checked == planned == {
        "frontend": [f"scheduler_cls={SCHEDULER}", f"worker_extension_cls={EXTENSION}"],
        "engine core": [f"scheduler_cls={SCHEDULER}"],
        "worker rank 0": [f"worker_extension_cls={EXTENSION}"],
        "worker rank 1": [f"worker_extension_cls={EXTENSION}"],
    }


@pytest.mark.parametrize("option, path, problem", [
    ("scheduler_cls", "ae_bad_hooks:NotAScheduler",
     "is not a subclass of asyncengine.engine_core.scheduler:Scheduler; subclass asyncengine.plugins_api.Scheduler, "
     "or implement every method of asyncengine.plugins_api.SchedulerInterface: NotAScheduler lacks "
     + ", ".join(SCHEDULER_METHODS)),
    ("worker_extension_cls", "ae_bad_hooks:ClashingExtension",
     "defines public method 'load_model', which the worker class asyncengine.worker.worker:Worker already has: "
     "collective_rpc('load_model') finds the worker's first, so ae_bad_hooks:ClashingExtension.load_model would "
     "never run; rename it in the extension"),
])
@pytest.mark.extension_point("C1", "C3", "G5")
def test_a_wrong_class_fails_start_up_in_the_frontend_before_spawning(llama, tmp_path, plugin_env, option, path,
                                                                      problem):
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "ae_bad_hooks.py").write_text(BAD_HOOKS)
    env = plugin_env(*DISTRIBUTIONS)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(modules)])
    # The other hook is set to a good class: only the wrong one is reported.
    hooks = {"scheduler_cls": SCHEDULER, "worker_extension_cls": EXTENSION, option: path}
    result, trace_file = run_script(tmp_path, env, llama.path, hooks, "failing")
    assert result.get("error") == "ConfigError", result
    assert result["field"] == option
    assert result["message"] == (
        f"the frontend (pid {result['pid']}) failed in start-up phase 'config hooks': {option}: {path} {problem}"
    )
    assert {record.role for record in read_trace(trace_file)} == {"frontend"}  # nothing was spawned
