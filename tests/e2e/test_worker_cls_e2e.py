"""`worker_cls` (EXTENSION_POINTS.md C2) end to end: a Worker subclass, on PYTHONPATH, is built by the
worker process (in_process=False, distributed_executor_backend="mp") and by the in-process uni
executor instead of the built-in Worker; a class that is not a Worker fails start-up in the frontend,
before anything is spawned, naming the option and the value."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.plugin_runtime.records import read_trace

MODULE = '''
import json, os
from asyncengine.plugins_api import Worker, current_process_role


def _record(event, worker):
    path = os.environ.get("AE_PLUGIN_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps({"event": event, "pid": os.getpid(), "role": current_process_role(),
                                   "rank": worker.rank}) + "\\n")


class RecordingWorker(Worker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _record("init", self)

    def load_model(self):
        _record("load_model", self)
        return super().load_model()


class NotAWorker:
    pass
'''

SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams

model, options, trace_file = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
options.update(skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20, startup_trace=trace_file)
prompts = [{"prompt_token_ids": [5 + i, 6, 7 + 2 * i, 8, 9 + 3 * i]} for i in range(3)]
result = {"pid": os.getpid()}
try:
    with LLM(model, **options) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        result["tokens"] = [list(output.outputs[0].token_ids) for output in outputs]
except Exception as error:
    result.update(error=type(error).__name__, field=getattr(error, "field", None), message=str(error))
print(json.dumps(result))
"""


@pytest.fixture
def run(tiny_model, tmp_path):
    model = tiny_model("llama").path
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "ae_worker_cls_test.py").write_text(MODULE)
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    record = tmp_path / "record.jsonl"

    def run_script(name: str, **options) -> tuple[dict, Path, list[dict]]:
        env = {k: v for k, v in os.environ.items() if k not in ("ASYNCENGINE_PLUGINS", "PYTHONPATH")}
        env.update(PYTHONPATH=str(modules), AE_PLUGIN_RECORD=str(record))
        record.unlink(missing_ok=True)
        trace_file = tmp_path / f"{name}-trace.json"
        result = subprocess.run([sys.executable, str(script), str(model), json.dumps(options), str(trace_file)],
                                capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr
        records = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
        return json.loads(result.stdout.strip().splitlines()[-1]), trace_file, records

    return run_script


@pytest.mark.extension_point("C2")
def test_the_worker_class_is_built_in_the_worker_process_and_in_process(run):
    baseline, _, records = run("baseline", in_process=False, distributed_executor_backend="mp")
    assert "error" not in baseline, baseline
    assert records == []

    result, trace_file, records = run("mp", in_process=False, distributed_executor_backend="mp",
                                      worker_cls="ae_worker_cls_test:RecordingWorker")
    assert "error" not in result, result
    assert result["tokens"] == baseline["tokens"]
    pids = {record.role: record.pid for record in read_trace(trace_file)}
    assert set(pids) == {"frontend", "engine core", "worker rank 0"}
    assert [(r["event"], r["role"], r["pid"], r["rank"]) for r in records] == [
        ("init", "worker rank 0", pids["worker rank 0"], 0), ("load_model", "worker rank 0", pids["worker rank 0"], 0)]
    assert pids["worker rank 0"] != result["pid"]
    checked = {(record.role, record.plugin) for record in read_trace(trace_file) if record.phase == "config hooks"
               and record.plugin is not None}
    assert checked == {("frontend", "worker_cls=ae_worker_cls_test:RecordingWorker"),
                       ("worker rank 0", "worker_cls=ae_worker_cls_test:RecordingWorker")}

    result, _, records = run("uni", in_process=True, distributed_executor_backend="uni",
                             worker_cls="ae_worker_cls_test:RecordingWorker")
    assert "error" not in result, result
    assert result["tokens"] == baseline["tokens"]
    assert [(r["event"], r["role"], r["pid"]) for r in records] == [
        ("init", "frontend", result["pid"]), ("load_model", "frontend", result["pid"])]


@pytest.mark.extension_point("C2")
def test_a_class_that_is_not_a_worker_fails_before_spawning(run):
    path = "ae_worker_cls_test:NotAWorker"
    result, trace_file, records = run("failing", in_process=False, distributed_executor_backend="mp", worker_cls=path)
    assert result.get("error") == "ConfigError", result
    assert result["field"] == "worker_cls"
    assert result["message"] == (
        f"the frontend (pid {result['pid']}) failed in start-up phase 'config hooks': worker_cls: {path} is not a "
        "subclass of asyncengine.worker.worker:Worker; subclass asyncengine.plugins_api.Worker (the worker "
        "interface: each worker builds it with Worker's arguments and the engine core calls its methods by name)")
    assert {record.role for record in read_trace(trace_file)} == {"frontend"}  # nothing was spawned
    assert records == []
