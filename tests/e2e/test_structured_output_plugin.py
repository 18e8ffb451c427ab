"""Row R10: a structured-output backend from a plugin distribution (asyncengine-structured-output-example,
installed into a temporary target on PYTHONPATH) runs in the engine core, where the masks are computed.

Multiprocess (engine core and worker in their own processes), on the tiny Llama with the tiny byte-level
tokenizer. The backend `choice_trie` appends {"plugin", "event", "pid", "role"} lines to AE_PLUGIN_RECORD;
they must come from the engine core's process (its pid in the start-up trace) and from nowhere else.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.plugin_runtime.records import read_trace
from support.tiny_tokenizer import save_tiny_tokenizer

DIST, PLUGIN = "asyncengine-structured-output-example", "ae_structured_output_example"
CHOICES = ["alpha", "beta", "gamma delta"]

SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams, StructuredOutputsParams

model, trace_file, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
result = {"pid": os.getpid()}
try:
    settings = dict(in_process=False, distributed_executor_backend="mp", max_model_len=256,
                    kv_cache_memory_bytes=8 * 2**20, startup_trace=trace_file)
    with LLM(model, **{**settings, **options}) as llm:
        outputs = llm.generate(["a", "bb", "ccc"], [
            SamplingParams(temperature=temperature, seed=seed, max_tokens=32,
                           structured_outputs=StructuredOutputsParams(choice=%(choices)r))
            for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2))])
        result["texts"] = [o.outputs[0].text for o in outputs]
        result["finish"] = [o.outputs[0].finish_reason for o in outputs]
        try:
            llm.generate(["a"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))
        except Exception as error:
            result.update(error=type(error).__name__, message=str(error), field=getattr(error, "field", None))
except Exception as error:
    result.update(failed=type(error).__name__, message=str(error))
print(json.dumps(result))
""" % {"choices": CHOICES}


@pytest.fixture(scope="module")
def model_with_tokenizer(tiny_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("so-e2e") / "model"
    shutil.copytree(tiny_model("llama").path, directory)
    save_tiny_tokenizer(directory)
    return directory


@pytest.mark.slow
@pytest.mark.extension_point("R10")
def test_a_plugin_backend_computes_the_masks_in_the_engine_core(model_with_tokenizer, plugin_env, tmp_path):
    record = tmp_path / "records.jsonl"
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    trace_file = tmp_path / "trace.json"
    options = {"structured_outputs_config": {"backend": "choice_trie"}}
    completed = subprocess.run(
        [sys.executable, str(script), str(model_with_tokenizer), str(trace_file), json.dumps(options)],
        capture_output=True, text=True, env=plugin_env(DIST, AE_PLUGIN_RECORD=str(record)), timeout=300)
    assert completed.returncode == 0, completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert "failed" not in result, result
    # A random-weight model writes one of the choices only because the plugin's masks constrain it.
    assert all(text in CHOICES for text in result["texts"]), result["texts"]
    assert result["finish"] == ["stop"] * 3
    # The backend refuses what it does not take, naming itself and the field, in the frontend (a 400 over HTTP).
    assert result["error"] == "GrammarError" and result["field"] == "structured_outputs.regex", result
    assert "'choice_trie'" in result["message"] and "supports only 'choice'" in result["message"]

    trace = read_trace(trace_file)
    pids = {r.role: r.pid for r in trace}
    assert set(pids) == {"frontend", "engine core", "worker rank 0"} and len(set(pids.values())) == 3
    assert pids["frontend"] == result["pid"]
    events = [json.loads(line) for line in record.read_text().splitlines()]
    assert {(e["event"], e["role"], e["pid"]) for e in events if e["plugin"] == PLUGIN} == {
        ("backend built", "engine core", pids["engine core"]),
        ("mask computed", "engine core", pids["engine core"]),
    }
    # The registry is read in the engine core, so the manifest check compared it there and found the key.
    loaded = {r.role for r in trace if r.plugin == PLUGIN and r.group and r.outcome == "ok"}
    assert {"frontend", "engine core"} <= loaded
