"""A quantization method from a plugin distribution (R4), end to end, with the first-party
asyncengine-quantization-example: `example_int4`, int4 weight-only, per group of 32 input columns with a
float16 scale and minimum (GGUF Q4_1's layout), two weights per byte.

A user's script runs in a fresh interpreter with exactly that distribution on its PYTHONPATH, on the
tiny Llama: the int4 model with the engine core and the worker in processes of their own, and, as the
reference, the float32 engine in-process on a copy of the checkpoint whose linear weights went through
the same int4 round trip. It shows:
- the method's verify_config ran in the frontend (the script's process) and its layers were built in
  the worker process, each by pid and role;
- the worker keeps the weights packed: its parameter bytes, measured there (collective_rpc "describe"),
  are exactly float32's minus the linear weights' 4 bytes per element plus 1/2 + 4/32;
- the int4 model computes what it claims: greedy tokens and logprobs of the round-tripped float32 model.
  (How close that is to the original float32 depends on the weights: the tiny model's are Gaussian, ~8%
  round-trip error; the default model's come from a Q4_1 file and come back exactly: docs/quantization.md);
- registering the method (what its general plugin does) resolves no platform and imports no torch.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.plugin_runtime.records import read_trace

DIST = "asyncengine-quantization-example"
SOURCE = Path(__file__).resolve().parents[2] / "plugins" / DIST / "src"
NUM_TOKENS = 12

SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams

model, trace_file, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
options = dict(skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20)
params = SamplingParams(temperature=0.0, max_tokens=%(tokens)d, ignore_eos=True, logprobs=5)
result = {"pid": os.getpid()}
runs = {"example_int4": (model, dict(quantization="example_int4", in_process=False,
                                     distributed_executor_backend="mp", startup_trace=trace_file)),
        "round_trip_float32": (sys.argv[4], {})}
for name, (path, extra) in runs.items():
    with LLM(path, **options, **extra) as llm:
        outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        result[name] = {"described": llm.collective_rpc("describe"),
                        "tokens": [list(o.token_ids) for o in outputs],
                        "logprobs": [[{str(k): v for k, v in step.items()} for step in o.logprobs] for o in outputs]}
print(json.dumps(result))
""" % {"tokens": NUM_TOKENS}

REGISTER = r"""
import json, sys
import ae_quant_example
from asyncengine.errors import StartupError
from asyncengine.plugins_api import QuantizationRegistry, current_platform

ae_quant_example.register()
try:
    current_platform()
    platform = "resolved"
except StartupError:
    platform = "unresolved"
print(json.dumps({"platform": platform, "torch": "torch" in sys.modules, "known": sorted(QuantizationRegistry.keys())}))
"""


def round_tripped_copy(model_dir: Path, target: Path) -> Path:
    """A copy of the checkpoint whose linear weights (not the embeddings, lm_head, norms) are their int4
    round trip, computed with the distribution's own functions (imported from its source tree)."""
    import torch
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(SOURCE))
    try:
        from ae_quant_example.int4 import dequantize_int4, group_size_for, quantize_int4
    finally:
        sys.path.remove(str(SOURCE))
    shutil.copytree(model_dir, target)
    for file in target.glob("*.safetensors"):
        tensors = load_file(file)
        for name, weight in tensors.items():
            if name.endswith("proj.weight"):
                size = group_size_for(weight.shape[1])
                tensors[name] = dequantize_int4(*quantize_int4(weight, size), size, torch.float32).contiguous()
        save_file(tensors, file, metadata={"format": "pt"})
    return target


def linear_elements(config) -> tuple[int, list[int]]:
    """Weight elements of the tiny Llama's linear layers (lm_head excluded), and each layer's input width."""
    hidden, inter, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    head_dim = hidden // heads
    q, kv = heads * head_dim, config.num_key_value_heads * head_dim
    shapes = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)] * config.num_hidden_layers
    return sum(rows * cols for rows, cols in shapes), [cols for _, cols in shapes]


@pytest.mark.extension_point("R4")
def test_the_int4_method_is_verified_in_the_frontend_built_in_the_worker_and_packs_the_weights(
        tiny_model, tmp_path, plugin_env):
    model = tiny_model("llama")
    record_file = tmp_path / "record.jsonl"
    rng = random.Random(5)
    prompts = [[rng.randrange(3, model.vocab_size) for _ in range(n)] for n in (3, 8, 17, 40)]
    trace_file = tmp_path / "trace.json"
    reference = round_tripped_copy(model.path, tmp_path / "round-tripped")
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(model.path), str(trace_file), json.dumps(prompts),
                             str(reference)],
                            capture_output=True, text=True, timeout=300,
                            env=plugin_env(DIST, AE_PLUGIN_RECORD=str(record_file)))
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])

    pids = {r.role: r.pid for r in read_trace(trace_file)}
    assert set(pids) == {"frontend", "engine core", "worker rank 0"} and pids["frontend"] == outcome["pid"]
    records = [json.loads(line) for line in record_file.read_text().splitlines()]
    # Nothing of the method ran for the float32 reference; for the int4 run: verified in the frontend,
    # before anything was spawned, and every linear layer built in the worker process.
    (verified,) = [r for r in records if r["event"] == "verified"]
    assert (verified["role"], verified["pid"]) == ("frontend", pids["frontend"])
    assert set(verified["group_sizes"].values()) == {32}
    built = [r for r in records if r["event"] == "layer built"]
    elements, widths = linear_elements(model.hf_model.config)
    assert {(r["role"], r["pid"]) for r in built} == {("worker rank 0", pids["worker rank 0"])}
    assert sorted(r["input_size"] for r in built) == sorted(widths) and {r["group_size"] for r in built} == {32}
    assert len(records) == 1 + len(widths)

    # Resident bytes, measured in the worker: linear weights go from 4 bytes an element to 1/2 + 4/32.
    float_bytes = outcome["round_trip_float32"]["described"][0]["parameter_bytes"]
    (described,) = outcome["example_int4"]["described"]
    assert (described["pid"], described["rank"]) == (pids["worker rank 0"], 0)
    assert described["parameter_bytes"] == float_bytes - 4 * elements + elements // 2 + 4 * elements // 32
    assert (elements // 2 + 4 * elements // 32) / (4 * elements) < 0.16

    # The int4 model is the round-tripped float32 model: the same tokens, the same logprobs (to float rounding:
    # the worker dequantizes to exactly the reference's weights, and the matmuls are the same).
    int4, float32 = outcome["example_int4"], outcome["round_trip_float32"]
    assert int4["tokens"] == float32["tokens"] and all(len(t) == NUM_TOKENS for t in int4["tokens"])
    worst = max(abs(steps[key] - ref[key]) for run, ref_run in zip(int4["logprobs"], float32["logprobs"])
                for steps, ref in zip(run, ref_run) for key in ref)
    assert worst < 1e-4, worst


@pytest.mark.extension_point("R4")
def test_registering_resolves_no_platform(plugin_env):
    result = subprocess.run([sys.executable, "-c", REGISTER], capture_output=True, text=True, timeout=120,
                            env=plugin_env(DIST))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"platform": "unresolved", "torch": False, "known": ["example_int4", "gguf", "int8", "int8_dynamic"]}


REFUSED = r"""
import json, os, sys
from asyncengine import LLM

result = {"pid": os.getpid()}
try:
    LLM(sys.argv[1], quantization="example_int4", in_process=False, distributed_executor_backend="mp",
        hf_overrides={"intermediate_size": 164}, skip_tokenizer_init=True, max_model_len=512,
        kv_cache_memory_bytes=8 * 2**20, startup_trace=sys.argv[2])
except Exception as error:
    result.update(error=type(error).__name__, field=getattr(error, "field", None), message=str(error))
print(json.dumps(result))
"""


@pytest.mark.extension_point("R4")
def test_verify_config_refuses_in_the_frontend_before_anything_is_spawned(tiny_model, tmp_path, plugin_env):
    # A model whose down_proj input width (164) no group size divides: the method's verify_config says so
    # in the frontend, before the engine core or a worker exists (and before any weight is read).
    trace_file = tmp_path / "trace.json"
    result = subprocess.run([sys.executable, "-c", REFUSED, str(tiny_model("llama").path), str(trace_file)],
                            capture_output=True, text=True, timeout=300, env=plugin_env(DIST))
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome.get("error") == "ConfigError" and outcome["field"] == "quantization", outcome
    assert "intermediate_size per rank (down_proj input) = 164" in outcome["message"], outcome["message"]
    assert f"frontend (pid {outcome['pid']})" in outcome["message"], outcome["message"]
    assert {r.role for r in read_trace(trace_file)} == {"frontend"}
