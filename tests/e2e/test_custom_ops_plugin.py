"""The first-party custom-ops plugin (plugins/asyncengine-custom-ops-example), installed as a real
distribution, in a multiprocess engine (engine core and worker in processes of their own).

A user's script runs in a fresh interpreter with exactly that distribution on PYTHONPATH (or none). The
plugin's general entry point replaces the in-tree RMSNorm (`CustomOp.register_oot`) and adds a provider
of op "silu_and_mul"; each appends a line to AE_PLUGIN_RECORD the first time it runs in a process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.plugin_runtime.records import OK, read_trace

DIST = "asyncengine-custom-ops-example"

SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams

model, trace_file, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
options = dict(in_process=False, distributed_executor_backend="mp", skip_tokenizer_init=True, max_model_len=512,
               kv_cache_memory_bytes=8 * 2**20, startup_trace=trace_file, **extra)
prompts = [{"prompt_token_ids": [5 + i, 6, 7 + 2 * i, 8, 9 + 3 * i]} for i in range(4)]
with LLM(model, **options) as llm:
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
print(json.dumps({"pid": os.getpid(), "tokens": [list(output.outputs[0].token_ids) for output in outputs]}))
"""


@pytest.fixture(scope="module")
def llama_path(tiny_model) -> str:
    return str(tiny_model("llama").path)


def run(tmp_path: Path, env: dict[str, str], model: str, name: str, **extra) -> tuple[dict, list, list[dict]]:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    trace_file = tmp_path / f"{name}-trace.json"
    result = subprocess.run([sys.executable, str(script), model, str(trace_file), json.dumps(extra)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    record = Path(env["AE_PLUGIN_RECORD"])
    lines = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return json.loads(result.stdout.strip().splitlines()[-1]), read_trace(trace_file), lines


def op_records(trace, role: str) -> dict[str, str]:
    return {r.plugin: r.reason for r in trace if r.role == role and r.phase == "load model"
            and r.plugin and r.plugin.startswith(("op:", "custom op:"))}


@pytest.mark.extension_point("R2")
def test_the_plugin_ops_run_in_the_worker_and_keep_greedy_outputs(llama_path, tmp_path, plugin_env):
    record = str(tmp_path / "record.jsonl")
    plain, plain_trace, plain_lines = run(tmp_path, plugin_env(AE_PLUGIN_RECORD=record), llama_path, "plain")
    assert plain_lines == []
    outcome, trace, lines = run(tmp_path, plugin_env(DIST, AE_PLUGIN_RECORD=record), llama_path, "plugin")

    # Numerically equal to the in-tree ops: the same greedy tokens.
    assert outcome["tokens"] == plain["tokens"]

    # Both ran in the worker process, not the script's (nor the engine core's): once each there.
    assert [line["what"] for line in lines] == ["custom op forward", "op provider silu_and_mul"]
    assert {line["role"] for line in lines} == {"worker rank 0"}
    assert len({line["pid"] for line in lines}) == 1 and lines[0]["pid"] != outcome["pid"]

    # The worker's start-up report says which provider each op prefers, and what replaced RMSNorm.
    chosen = op_records(trace, "worker rank 0")
    assert chosen["op:silu_and_mul"].startswith("provider ae_example (priority list: ae_example, native;")
    assert chosen["op:rms_norm"] == "provider native (priority list: native; from registered priorities)"
    assert chosen["op:rotary"].startswith("provider native")
    assert "ae_custom_ops_example:ExampleRMSNorm replaces the in-tree RMSNorm (registered by plugin" in \
        chosen["custom op:RMSNorm"]
    assert op_records(plain_trace, "worker rank 0").keys() == {"op:fused_moe", "op:rms_norm", "op:rotary", "op:sample",
                                                               "op:silu_and_mul"}
    # The manifest check compared both registries in the worker: the plugin's keys are there too.
    compared = {r.plugin: r for r in trace if r.role == "worker rank 0" and r.phase == "manifest check"}
    assert compared["registry:custom_ops"].outcome == compared["registry:op_providers"].outcome == OK


@pytest.mark.extension_point("R2")
def test_op_priority_in_the_config_puts_native_first(llama_path, tmp_path, plugin_env):
    record = str(tmp_path / "record.jsonl")
    env = plugin_env(DIST, AE_PLUGIN_RECORD=record)
    _outcome, trace, lines = run(tmp_path, env, llama_path, "native-first",
                                 op_priority={"silu_and_mul": ["native"]})
    assert op_records(trace, "worker rank 0")["op:silu_and_mul"] == (
        "provider native (priority list: native, ae_example; from op_priority in the config)")
    assert [line["what"] for line in lines] == ["custom op forward"]  # the provider never ran
