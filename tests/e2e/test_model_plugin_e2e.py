"""An out-of-tree model architecture (R1), end to end, with the first-party plugin distribution
asyncengine-model-example.

A user's script runs in a fresh interpreter with exactly the distributions it needs on its PYTHONPATH
(`plugin_env`) and serves a copy of the tiny Llama whose config.json names the plugin's architecture,
`ExampleLlamaForCausalLM`, with the engine core in its own process and two tensor-parallel worker
processes. It shows:
- the general plugin's registration reaches every process: the model is built in "worker rank 0" and
  "worker rank 1" (processes other than the script's), and greedy outputs equal the stock Llama's;
- without the plugin installed, start-up fails in the frontend, before anything is spawned, saying
  the architecture is not supported.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.plugin_runtime.records import read_trace

DISTRIBUTION = "asyncengine-model-example"
ARCHITECTURE = "ExampleLlamaForCausalLM"
NUM_PROMPTS, NUM_TOKENS = 4, 16

SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams

model, trace_file = sys.argv[1], sys.argv[2]
options = dict(in_process=False, distributed_executor_backend="mp", tensor_parallel_size=2,
               skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20,
               startup_trace=trace_file)
prompts = [{"prompt_token_ids": [5 + i, 6, 7 + 2 * i, 8, 9 + 3 * i]} for i in range(%(num_prompts)d)]
result = {"pid": os.getpid()}
try:
    with LLM(model, **options) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=%(num_tokens)d, ignore_eos=True))
        result["tokens"] = [list(output.outputs[0].token_ids) for output in outputs]
        result["model_class"] = [answer["model_class"] for answer in llm.collective_rpc("describe")]
except Exception as error:
    result.update(error=type(error).__name__, message=str(error))
print(json.dumps(result))
""" % {"num_prompts": NUM_PROMPTS, "num_tokens": NUM_TOKENS}


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    """The tiny Llama, and a copy whose config.json names the plugin's architecture."""
    stock = tiny_model("llama").path
    copy = tmp_path_factory.mktemp("example-llama") / "model"
    shutil.copytree(stock, copy)
    config = json.loads((copy / "config.json").read_text())
    config["architectures"] = [ARCHITECTURE]
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    return stock, copy


def run_script(tmp_path: Path, env: dict[str, str], model: Path, name: str) -> tuple[dict, Path]:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    trace_file = tmp_path / f"{name}-trace.json"
    result = subprocess.run([sys.executable, str(script), str(model), str(trace_file)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), trace_file


@pytest.mark.extension_point("E1", "R1")
def test_the_plugin_architecture_is_built_in_every_worker_and_matches_the_stock_llama(models, tmp_path, plugin_env):
    stock, example = models
    record_file = tmp_path / "plugin-record.jsonl"
    env = plugin_env(DISTRIBUTION, AE_PLUGIN_RECORD=str(record_file))
    baseline, _ = run_script(tmp_path, env, stock, "stock")
    assert "error" not in baseline, baseline
    assert not record_file.exists()  # the stock architecture does not build the plugin's class
    result, trace_file = run_script(tmp_path, env, example, "example")
    assert "error" not in result, result

    assert result["tokens"] == baseline["tokens"]
    assert all(len(tokens) == NUM_TOKENS for tokens in result["tokens"])
    assert result["model_class"] == [f"ae_model_example.model:{ARCHITECTURE}"] * 2
    assert baseline["model_class"] == ["asyncengine.models.llama:LlamaForCausalLM"] * 2

    pids = {record.role: record.pid for record in read_trace(trace_file)}
    assert set(pids) == {"frontend", "engine core", "worker rank 0", "worker rank 1"}
    records = [json.loads(line) for line in record_file.read_text().splitlines()]
    built = sorted((r["role"], r["pid"]) for r in records if r["plugin"] == "ae_model_example" and r["event"] == "built")
    assert built == [("worker rank 0", pids["worker rank 0"]), ("worker rank 1", pids["worker rank 1"])]
    assert all(pid != result["pid"] for _, pid in built)
    assert len({pid for _, pid in built}) == 2


@pytest.mark.extension_point("R1")
def test_without_the_plugin_start_up_fails_in_the_frontend(models, tmp_path, plugin_env):
    _, example = models
    env = plugin_env()  # no plugin distribution on the path
    result, trace_file = run_script(tmp_path, env, example, "no-plugin")
    assert "error" in result, result
    assert f"model architecture(s) {ARCHITECTURE} of {example} are not supported for now" in result["message"], result
    assert "LlamaForCausalLM" in result["message"].split("supported:")[-1]  # the supported ones are listed
    assert "frontend" in result["message"], result
    if trace_file.exists():
        assert {record.role for record in read_trace(trace_file)} == {"frontend"}  # nothing was spawned
