"""An out-of-tree platform (E2, the Platform interface P, C2 worker_cls "auto", R3), end to end, with the
first-party distribution asyncengine-platform-example.

A user's script runs in a fresh interpreter with exactly that distribution on its PYTHONPATH
(`plugin_env`): the engine core in its own process, two tensor-parallel worker processes, on the tiny
Llama (the stock reference runs in-process, one rank). Installed but not switched on, the platform stays out of the way (the built-in cpu platform is
detected); with AE_PLATFORM_EXAMPLE=1 it is detected and wins over the built-ins. It shows:
- the platform resolved in every process (frontend, engine core, each worker), each by pid and role;
- its check_and_update_config ran in the frontend and set worker_cls "auto" to its worker, which each
  worker process built (pid + role), with the thread count of the option the platform claims;
- its attention backend, registered by its general plugin, served every layer in the workers (the
  start-up report's choice, the backend's own call counts through collective_rpc, its forward's record);
- greedy output equals the stock cpu platform's;
- the option it adds to the CLI (pre_register_and_update) shows in `generate --help` when it is chosen
  with --device, and not when it is not.
One engine start per platform: every assertion about a run reads that run's records.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.plugin_runtime.records import read_trace

DIST = "asyncengine-platform-example"
ROLES = {"frontend", "engine core", "worker rank 0", "worker rank 1"}
WORKERS = ("worker rank 0", "worker rank 1")

SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams

model, trace_file = sys.argv[1], sys.argv[2]
options = dict(skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20,
               startup_trace=trace_file, **json.loads(sys.argv[3]))
prompts = [{"prompt_token_ids": [5 + i, 6, 7 + 2 * i, 8, 9 + 3 * i, 10, 11]} for i in range(3)]
result = {"pid": os.getpid()}
with LLM(model, **options) as llm:
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    result["tokens"] = [list(output.outputs[0].token_ids) for output in outputs]
    result["described"] = llm.collective_rpc("describe")
    if sys.argv[4] == "report":
        result["reports"] = llm.collective_rpc("example_report")
print(json.dumps(result))
"""


def run_script(tmp_path: Path, env: dict[str, str], model: str, name: str, options: dict,
               report: bool) -> tuple[dict, list]:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    trace_file = tmp_path / f"{name}-trace.json"
    result = subprocess.run([sys.executable, str(script), model, str(trace_file), json.dumps(options),
                             "report" if report else "no"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), read_trace(trace_file)


@pytest.mark.extension_point("E2", "P", "C2", "R3")
def test_the_platform_runs_every_process_its_worker_and_backend_and_matches_stock_cpu(tiny_model, tmp_path,
                                                                                       plugin_env):
    model = str(tiny_model("llama").path)
    record_file = tmp_path / "record.jsonl"

    # Installed, not switched on: the built-in cpu platform, and nothing of the plugin's runs but its detector.
    env = plugin_env(DIST, AE_PLUGIN_RECORD=str(record_file))
    # (In-process, one rank: the cheap reference; its detector ran all the same.)
    stock, stock_trace = run_script(tmp_path, env, model, "stock", {}, report=False)
    chosen = {r.role: r.plugin for r in stock_trace if r.phase == "platform" and (r.plugin or "").startswith("chosen")}
    assert chosen == {"frontend": "chosen: cpu"}, chosen
    (verdict,) = [r for r in stock_trace if r.role == "frontend" and r.plugin == "cpu_example"]
    assert verdict.reason == "inactive (returned None)"
    assert not record_file.exists()
    assert [d["platform"] for d in stock["described"]] == ["cpu"]

    env = plugin_env(DIST, AE_PLUGIN_RECORD=str(record_file), AE_PLATFORM_EXAMPLE="1")
    options = dict(in_process=False, distributed_executor_backend="mp", tensor_parallel_size=2,
                   additional_config={"example_threads": 1})
    result, trace = run_script(tmp_path, env, model, "example", options, report=True)
    assert result["tokens"] == stock["tokens"]  # greedy: the cpu platform's numerics (to float rounding)
    assert all(len(tokens) == 12 for tokens in result["tokens"])

    pids = {r.role: r.pid for r in trace}
    assert set(pids) == ROLES and pids["frontend"] == result["pid"] and len(set(pids.values())) == 4
    chosen = {r.role: (r.plugin, r.reason) for r in trace if r.phase == "platform"
              and (r.plugin or "").startswith("chosen")}
    assert chosen == {"frontend": ("chosen: cpu_example", "detected"),
                      **{role: ("chosen: cpu_example", "chosen by the frontend") for role in ROLES - {"frontend"}}}
    records = [json.loads(line) for line in record_file.read_text().splitlines()]

    def where(event: str) -> list[tuple[str, int]]:
        return sorted((r["role"], r["pid"]) for r in records if r["event"] == event)

    # The detector answered in every process: in the frontend by the environment variable, in the
    # children because the frontend named the platform.
    assert where("detected") == sorted((role, pids[role]) for role in ROLES)
    assert {r["why"] for r in records if r["event"] == "detected" and r["role"] != "frontend"} == {"device 'cpu_example'"}
    assert where("check_and_update_config") == [("frontend", pids["frontend"])]
    (checked,) = [r for r in records if r["event"] == "check_and_update_config"]
    assert checked["worker_cls"] == "ae_platform_example.worker:ExampleWorker"

    # Its worker class, built in each worker process, with the platform's option applied there.
    workers = [(role, pids[role]) for role in WORKERS]
    assert where("worker built") == workers
    assert {r["cls"] for r in records if r["event"] == "worker built"} == {"ae_platform_example.worker:ExampleWorker"}
    assert sorted((r["role"], r["threads"]) for r in records if r["event"] == "device ready") == [
        (role, 1) for role in WORKERS]

    # Its attention backend: chosen by the platform in each worker, for every layer, and it ran there.
    assert {role for role, _ in where("get_attn_backend_cls")} == set(WORKERS)
    assert where("attention forward") == workers
    choices = {r.role: r.reason for r in trace if r.plugin == "attention backend"}
    assert set(choices) == set(WORKERS)
    for reason in choices.values():
        assert reason.startswith("all 2 layers: EXAMPLE_SDPA (chosen by platform cpu_example; registered by plugin "
                                 "'ae_platform_example' (asyncengine-platform-example"), reason
    reports = result["reports"]
    assert [(r["rank"], r["role"], r["pid"]) for r in reports] == [(i, role, pids[role]) for i, role in enumerate(WORKERS)]
    for report in reports:
        assert report["platform"] == "cpu_example" and report["threads"] == 1
        assert report["worker_class"] == "ae_platform_example.worker:ExampleWorker"
        assert report["attention_backends"] == ["ae_platform_example.attention:ExampleSdpaBackend"] * 2
        assert min(report["attention_calls"]) > 0  # every layer's backend ran
    assert [d["platform"] for d in result["described"]] == ["cpu_example", "cpu_example"]


@pytest.mark.extension_point("E2", "P")
def test_the_platform_adds_its_cli_option_only_when_chosen(plugin_env):
    env = plugin_env(DIST)

    def help_text(*args: str) -> str:
        result = subprocess.run([sys.executable, "-m", "asyncengine", "generate", *args, "--help"],
                                capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout

    chosen = help_text("--device", "cpu_example")
    assert "--example-threads N" in chosen and "[platform cpu_example] torch threads in each worker" in chosen
    assert "--example-threads" not in help_text()  # installed, not chosen: the built-in cpu platform
