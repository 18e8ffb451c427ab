"""A platform plugin written as vLLM's are (tests/plugins/vllm-shaped-platform), ported by
`asyncengine plugins port` alone and run, in-process and with the engine core and the worker in
processes of their own. It shows:
- the port tool mapped every use (its imports, entry-point groups and vLLM's worker class path);
- the entry point is named `vllm_shaped` while the platform's device_name is "ShapedDevice": every
  child process resolves it by the entry-point name the frontend used;
- its vLLM-style check_and_update_config, which changes the config in place through the sub-config
  views (parallel_config, scheduler_config, cache_config, compilation_config) and returns None, took
  effect: its worker class path was rewritten to ours, its scheduler (a dotted path) ran, and what has
  no meaning here (compilation_config.custom_ops, scheduler_config.is_multi_step, speculative_config)
  is listed in the start-up report as ignored;
- get_attn_backend_cls, an instance method with vLLM's parameters and no dist_backend set, was called
  by keyword in the worker, and its answer, a descriptor in vLLM's form, served through its
  get_impl_cls() class, built with vLLM's constructor keywords; `current_platform.device_name` (the object form) works in a general plugin;
- its rotary op, registered as vLLM's are (`@RotaryEmbedding.register_oot` on a subclass, under the
  in-tree op's name), declaring vLLM's constructor, was built by the model with vLLM's arguments and ran
  its forward_oot, which calls the base's (`super().forward_oot()`).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncengine.plugin_runtime.records import read_trace
from support.vllm_shaped import environment, port_and_install

SCRIPT = r"""
import json, sys
from asyncengine import LLM, SamplingParams

model, trace_file, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with LLM(model, skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=4 * 2**20,
         startup_trace=trace_file, **options) as llm:
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0.0, max_tokens=4,
                                                                               ignore_eos=True))
print(json.dumps([list(output.outputs[0].token_ids) for output in outputs]))
"""


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    return port_and_install("vllm-shaped-platform", tmp_path_factory.mktemp("vllm-shaped"))


def test_the_port_tool_maps_every_use(ported):
    _, report = ported
    assert "0 use(s) cannot be mapped" in report
    assert '"vllm.platform_plugins"  ->  "asyncengine.platform_plugins"' in report
    assert '"vllm.v1.worker.gpu_worker.Worker"  ->  "asyncengine.worker.worker:Worker"' in report
    assert "from vllm import envs  ->  from asyncengine.plugins_api import envs" in report


@pytest.mark.extension_point("E2", "P", "C1", "R2")
@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "multiprocess"])
def test_the_ported_platform_runs(ported, tiny_model, tmp_path, in_process):
    target, _ = ported
    record_file, trace_file = tmp_path / "record.jsonl", tmp_path / "trace.json"
    options = {} if in_process else {"in_process": False, "distributed_executor_backend": "mp"}
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tiny_model("llama").path), str(trace_file),
                             json.dumps(options)], capture_output=True, text=True, timeout=300,
                            env=environment(target, SHAPED_RECORD=str(record_file)))
    assert result.returncode == 0, result.stderr[-4000:]
    (tokens,) = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(tokens) == 4

    records = [json.loads(line) for line in record_file.read_text().splitlines()]
    events = {r["event"] for r in records}
    assert {"general plugin", "check_and_update_config", "get_attn_backend_cls", "scheduled",
            "rotary forward_oot", "attention impl"} <= events
    rotary = {(r["head_size"], r["rotary_dim"], r["is_neox_style"]) for r in records if r["event"] == "rotary built"}
    assert rotary == {(16, 16, True)}  # the model's call reached vLLM's constructor with vLLM's arguments
    built = {(r["head_size"], r["kv_cache_dtype"]) for r in records if r["event"] == "attention impl"}
    assert built == {(16, "auto")}  # get_impl_cls()'s class, built by vLLM's constructor keywords
    (checked,) = [r for r in records if r["event"] == "check_and_update_config"]
    assert checked["worker_cls"] == "asyncengine.worker.worker:Worker"
    assert checked["scheduler_cls"] == "vllm_shaped_platform.scheduler.CountingScheduler"
    assert {r["device_name"] for r in records if r["event"] == "general plugin"} == {"ShapedDevice"}
    asked = [(r["head_size"], r["use_v1"], r["use_mla"]) for r in records if r["event"] == "get_attn_backend_cls"]
    assert (16, True, False) in asked, asked  # the model's shape (64 is the start-up probe's)

    trace = read_trace(trace_file)
    chosen = {r.role: r.plugin for r in trace if r.phase == "platform" and (r.plugin or "").startswith("chosen")}
    roles = {"frontend"} if in_process else {"frontend", "engine core", "worker rank 0"}
    assert chosen == {role: "chosen: ShapedDevice" for role in roles}
    ignored = [r.reason for r in trace if (r.plugin or "").endswith(": ignored")]
    assert any("compilation_config.custom_ops = ['all']" in reason for reason in ignored), ignored
    assert any("scheduler_config.is_multi_step" in reason for reason in ignored), ignored
    # speculative_config is the engine's own now (docs/speculative_decoding.md): the hook reads its value (None
    # here, so the plugin's "no speculative decoding" branch is not taken), and nothing calls it ignored
    assert not any("speculative_config" in reason for reason in ignored), ignored
