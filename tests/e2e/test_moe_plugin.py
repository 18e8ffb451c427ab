"""The MoE op's provider from a plugin (issue 35, acceptance 3; rows R15 and R2): the first-party distribution
plugins/asyncengine-moe-example, installed as a real distribution, in a multiprocess engine (engine core and
worker in processes of their own), is chosen for op "fused_moe" in the worker, and its calls are counted there.

No MoE architecture ships yet, so the model is a test plugin's (tests/plugins/ae-plugin-moe-model): the tiny
Llama of tests/support/tiny_models.py with each MLP replaced by a router and a FusedMoE layer, its experts'
weights random (std 0.2, so the experts move the logits). Both write a JSON line to AE_PLUGIN_RECORD: the model
one per forward pass, the provider one per call.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncengine.plugin_runtime.records import read_trace

PROVIDER_DIST, MODEL_DIST = "asyncengine-moe-example", "ae-plugin-moe-model"
EXPERTS, TOP_K, INNER = 4, 2, 48

# Two engines one after the other in one user script (one interpreter start fewer): the first with only the
# model's plugin allowed, the second with the provider's too; each with its own record file, which its
# processes inherit from the environment when they start.
SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams

model, trace_dir, record_dir = sys.argv[1:4]
prompts = [{"prompt_token_ids": [5 + i, 6, 7 + 2 * i, 8, 9 + 3 * i]} for i in range(3)]
result = {"pid": os.getpid()}
for name, plugins in (("plain", "ae_moe_model"), ("plugin", "ae_moe_model,ae_moe_example")):
    os.environ["AE_PLUGIN_RECORD"] = os.path.join(record_dir, name + ".jsonl")
    options = dict(in_process=False, distributed_executor_backend="mp", skip_tokenizer_init=True, max_model_len=256,
                   kv_cache_memory_bytes=8 * 2**20, dtype="float32", plugins=plugins,
                   startup_trace=os.path.join(trace_dir, name + "-trace.json"))
    with LLM(model, **options) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5))
    result[name] = [{str(token): logprob for token, logprob in output.outputs[0].logprobs[0].items()}
                    for output in outputs]
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def moe_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny Llama's folder with architecture MoeTestForCausalLM: its MLP tensors swapped for a router and
    the stacked experts of a FusedMoE layer per decoder layer, in transformers' layout (gate_up_proj, down_proj)."""
    llama = tiny_model("llama").path
    folder = tmp_path_factory.mktemp("moe-test-model")
    config = json.loads((llama / "config.json").read_text())
    config.update(architectures=["MoeTestForCausalLM"], num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                  moe_intermediate_size=INNER, norm_topk_prob=True)
    (folder / "config.json").write_text(json.dumps(config))
    size = config["hidden_size"]
    tensors = {name: t for name, t in load_file(llama / "model.safetensors").items() if ".mlp." not in name}
    generator = torch.Generator().manual_seed(0)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp."
        tensors[prefix + "gate.weight"] = torch.randn(EXPERTS, size, generator=generator) * 0.2
        tensors[prefix + "experts.gate_up_proj"] = torch.randn(EXPERTS, 2 * INNER, size, generator=generator) * 0.2
        tensors[prefix + "experts.down_proj"] = torch.randn(EXPERTS, size, INNER, generator=generator) * 0.2
    save_file(tensors, folder / "model.safetensors")
    return folder


def run(tmp_path: Path, env: dict[str, str], model: Path) -> tuple[dict, dict[str, list], dict[str, list[dict]]]:
    """The script's output, and per engine ("plain", "plugin") its start-up trace and its record lines."""
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(model), str(tmp_path), str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    traces, records = {}, {}
    for name in ("plain", "plugin"):
        traces[name] = read_trace(tmp_path / f"{name}-trace.json")
        record = tmp_path / f"{name}.jsonl"
        records[name] = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return json.loads(result.stdout.strip().splitlines()[-1]), traces, records


def fused_moe_record(trace) -> str:
    (reason,) = [r.reason for r in trace if r.role == "worker rank 0" and r.phase == "load model"
                 and r.plugin == "op:fused_moe"]
    return reason


@pytest.mark.extension_point("R15", "R2")
def test_the_plugins_moe_provider_is_chosen_in_the_worker_and_its_calls_are_counted(moe_model, tmp_path, plugin_env):
    outcome, traces, records = run(tmp_path, plugin_env(MODEL_DIST, PROVIDER_DIST), moe_model)
    plain_trace, trace, plain_lines, lines = traces["plain"], traces["plugin"], records["plain"], records["plugin"]

    # Without the plugin, the worker runs the built-in op (on CPU, the grouped kernel behind `native`).
    assert fused_moe_record(plain_trace) == "provider native (priority list: native; from registered priorities)"
    assert {line["what"] for line in plain_lines} == {"forward"}
    # With it, the worker's start-up report names the plugin's provider first ...
    assert fused_moe_record(trace) == ("provider ae_moe_example (priority list: ae_moe_example, native; "
                                       "from registered priorities)")
    # ... and every call ran there: in the worker process (not the script's, nor the engine core's), one per
    # MoE layer and forward pass, on that pass's tokens.
    calls = [line for line in lines if line["what"] == "fused_moe"]
    passes = [line for line in lines if line["what"] == "forward"]
    assert passes and {line["role"] for line in calls + passes} == {"worker rank 0"}
    assert len({line["pid"] for line in calls + passes}) == 1 and calls[0]["pid"] != outcome["pid"]
    layers = json.loads((moe_model / "config.json").read_text())["num_hidden_layers"]
    assert [line["call"] for line in calls] == list(range(1, len(passes) * layers + 1))
    assert [line["tokens"] for line in calls] == [p["tokens"] for p in passes for _ in range(layers)]

    # The provider's results are what the model used: the first generated token's top-5 logprobs equal the
    # built-in op's to float32 rounding (the reference and the grouped kernel sum in different orders).
    for mine, theirs in zip(outcome["plugin"], outcome["plain"], strict=True):
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[token] - theirs[token]) < 1e-4 for token in mine)
