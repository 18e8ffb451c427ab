"""An attention backend from a plugin distribution (tests/plugins/ae-plugin-attention), in a multiprocess
engine (engine core and worker in processes of their own), on the tiny Llama.

A user's script runs in a fresh interpreter with exactly that distribution on PYTHONPATH and chooses the
plugin's backend "AE_RECORDING" (which delegates to the built-in "TORCH_PAGED") with the
`attention_backend` option. It shows: the backend ran in the worker process, not the script's; greedy
output equals the built-in backend's; the worker's start-up report holds the choice. A backend
registered only in the script is caught by the worker's manifest check, naming the registry.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.plugin_runtime.records import read_trace

DIST = "ae-plugin-attention"
OPTIONS = dict(skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, {"prompt_token_ids": [11, 12, 13]}]

SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams
from asyncengine.errors import StartupError
from asyncengine.plugins_api import register_attention_backend

model, backend, trace_file, register = sys.argv[1:5]
if register == "register":  # only in this process: the worker never sees it
    register_attention_backend(backend, "support.attention_backends:CountingBackend")
result = {"pid": os.getpid()}
try:
    with LLM(model, in_process=False, distributed_executor_backend="mp", attention_backend=backend,
             startup_trace=trace_file, **json.loads(sys.argv[5])) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate(json.loads(sys.argv[6]), params)
        result["tokens"] = [list(output.outputs[0].token_ids) for output in outputs]
except StartupError as error:
    result.update(error=type(error).__name__, message=str(error))
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def llama_path(tiny_model) -> str:
    return str(tiny_model("llama").path)


@pytest.fixture(scope="module")
def built_in_tokens(llama_path):
    """Greedy tokens of the built-in backend (in-process: the same torch code, the same numerics)."""
    from asyncengine import LLM, SamplingParams

    with LLM(llama_path, **OPTIONS) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        return [list(output.outputs[0].token_ids) for output in llm.generate(PROMPTS, params)]


def run(tmp_path: Path, env: dict[str, str], model: str, backend: str, register: str = "no") -> dict:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script), model, backend, str(tmp_path / "trace.json"), register,
                             json.dumps(OPTIONS), json.dumps(PROMPTS)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.extension_point("R3")
def test_the_plugin_backend_runs_in_the_worker_and_matches_the_built_in(llama_path, built_in_tokens, tmp_path,
                                                                        plugin_env):
    records_file = tmp_path / "record.jsonl"
    env = plugin_env(DIST, AE_PLUGIN_RECORD=str(records_file))
    outcome = run(tmp_path, env, llama_path, "AE_RECORDING")
    assert "error" not in outcome, outcome
    assert outcome["tokens"] == built_in_tokens

    # forward ran in the worker process only, not in the script's (nor the engine core's).
    records = [json.loads(line) for line in records_file.read_text().splitlines()]
    assert records == [{"what": "attention backend forward", "pid": records[0]["pid"], "role": "worker rank 0"}]
    assert records[0]["pid"] != outcome["pid"]

    # The worker's start-up report: its choice, in the 'load model' phase, under its own pid.
    trace = read_trace(tmp_path / "trace.json")
    (choice,) = [r for r in trace if r.plugin == "attention backend"]
    assert (choice.role, choice.pid, choice.phase, choice.outcome) == ("worker rank 0", records[0]["pid"],
                                                                       "load model", "ok")
    assert choice.reason.startswith("all 2 layers: AE_RECORDING (chosen by the attention_backend option; "
                                    "registered by plugin 'ae_attention' (ae-plugin-attention"), choice.reason
    (manifest,) = [r for r in trace if r.role == "worker rank 0" and r.plugin == "registry:attention_backends"]
    assert manifest.reason == "same keys as the frontend"


@pytest.mark.extension_point("R3", "X")
def test_a_backend_registered_only_in_the_script_is_caught_in_the_worker(llama_path, tmp_path, plugin_env):
    outcome = run(tmp_path, plugin_env(), llama_path, "AE_SCRIPT", register="register")
    assert outcome.get("error") == "MissingRegistration", outcome
    assert re.fullmatch(
        r"the worker rank 0 \(pid \d+\) failed in start-up phase 'manifest check': attention backend 'AE_SCRIPT' is "
        r"missing from registry 'attention_backends' here, while the frontend \(pid \d+\) has it \(registered there "
        r"by the calling script\): .* register it from a general plugin .*", outcome["message"]), outcome["message"]
