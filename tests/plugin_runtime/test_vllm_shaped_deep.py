"""vLLM-shaped plugins that only a started worker exercises (tests/plugins/vllm-shaped-deep, ported by
`plugins port` alone): `asyncengine plugins check --deep` passes for them (one worker per rank at TP=2, the
model built through their quantization method) and fails naming the plugin, the hook and the process for a
worker class whose init_device raises, a platform hook that raises in the worker, and a quantization method
whose create_weights raises; their vLLM-style int8 method serves a tiny model with tokens close to the
unquantized model's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.vllm_shaped import environment, port_and_install

PLUGIN = "vllm_shaped_deep"


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    target, report = port_and_install("vllm-shaped-deep", tmp_path_factory.mktemp("deep"))
    return target, report


def deep_check(target, *options, **env):
    return subprocess.run([sys.executable, "-m", "asyncengine", "plugins", "check", "--deep", *options],
                          capture_output=True, text=True, timeout=300, env=environment(target, **env))


def test_the_port_maps_every_vllm_name(ported):
    _, report = ported
    assert "15 mapped, 0 provided by name, 0 use(s) cannot be mapped" in report, report
    assert "from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod  ->  " \
           "from asyncengine.plugins_api import LinearBase, LinearMethodBase, UnquantizedLinearMethod" in report


def test_deep_check_passes_at_tp2_with_the_quantization_method(ported, tmp_path):
    target, _ = ported
    record = tmp_path / "record.txt"
    result = deep_check(target, "--tp", "2", "--in-process", "--quantization", "deep_int8", DEEP_RECORD=str(record))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "deep check passed" in result.stdout
    assert "chosen by platform DeepDevice" in result.stdout  # the plugin's platform, in the workers too
    lines = record.read_text().splitlines()
    # The platform's worker class, one per rank, each initialising its device with vLLM's attributes
    assert sorted(line for line in lines if line.startswith("init_device")) == [
        "init_device rank=0 local_rank=0 tp=2", "init_device rank=1 local_rank=1 tp=2"]
    # ...and each rank's 2 layers x (qkv, o, gate_up, down) quantized by the plugin's method, in its TP part:
    # the tiny config's qkv is 64 + 2 * 32 rows (4 query, 2 KV heads of 16), gate_up 2 * 128, halved per rank.
    quantized = sorted(line for line in lines if line.startswith("quantized"))
    assert quantized == sorted(2 * 2 * [
        "quantized QKVParallelLinear (64, 64) torch.int8", "quantized RowParallelLinear (64, 32) torch.int8",
        "quantized MergedColumnParallelLinear (128, 64) torch.int8", "quantized RowParallelLinear (64, 64) torch.int8"])
    # the other registered method was not built, and the report says so
    assert "not built: the plugins' quantization methods deep_int8_broken" in result.stdout


FAILURES = {
    # a worker class (vLLM's CPU worker's subclass) whose init_device raises: at TP=2 each rank is a process
    "init_device": (("--tp", "2", "--in-process"), {"DEEP_FAIL": "init_device"}, "vllm_shaped_deep.worker.DeepWorker",
                    "the worker rank ", "init device", "RuntimeError: rank "),
    # the platform's hook, called by the worker (here a thread of the frontend's process)
    "set_device": (("--in-process",), {"DEEP_FAIL": "set_device"}, "vllm_shaped_deep.platform.DeepPlatform",
                   "the frontend (pid ", "start workers", "RuntimeError: DeepDevice cannot be selected: no such card"),
    # a vLLM LinearMethodBase whose create_weights raises while the worker builds the model
    "create_weights": (("--in-process", "--quantization", "deep_int8_broken"), {},
                       "vllm_shaped_deep.quantization.BrokenCreateWeights", "the frontend (pid ", "load model",
                       "ValueError: deep_int8 needs input sizes divisible by 128, got 64"),
}


@pytest.mark.parametrize("hook", sorted(FAILURES))
def test_deep_check_names_the_plugin_the_hook_and_the_process(ported, hook):
    target, _ = ported
    options, env, owner, process, phase, detail = FAILURES[hook]
    result = deep_check(target, *options, **env)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    report = result.stderr[result.stderr.index("deep check failed:"):]
    assert f"  plugin:  {owner} (distribution {PLUGIN} 0.1)\n" in report, report
    assert f"  hook:    {hook}\n" in report, report
    assert f"  process: {process}" in report, report
    assert f"  phase:   {phase}\n" in report, report
    assert detail in report, report


SCRIPT = """
import json, sys
from asyncengine import LLM, SamplingParams

PROMPTS = [[5, 6, 7], [11, 12, 13, 14], [40, 3, 90], [7, 7, 8, 100, 2]]
OPTIONS = dict(in_process=True, skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=4 * 2**20)
next_step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)


def distributions(llm, contexts):
    return [{str(t): float(lp) for t, lp in r.outputs[0].logprobs[0].items()}
            for r in llm.generate([{"prompt_token_ids": c} for c in contexts], next_step)]


with LLM(sys.argv[1], **OPTIONS) as llm:  # one engine at a time: the float model first
    greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                          SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    # every prefix of the float model's greedy path: both models are asked for the same next token
    contexts = [p + list(r.outputs[0].token_ids[:k]) for p, r in zip(PROMPTS, greedy) for k in range(6)]
    plain = distributions(llm, contexts)
with LLM(sys.argv[1], quantization="deep_int8", **OPTIONS) as llm:
    quantized = distributions(llm, contexts)
with LLM(sys.argv[1], quantization="int8_dynamic", **OPTIONS) as llm:  # ours: the same W8A8 scheme
    built_in = distributions(llm, contexts)
print(json.dumps({"plain": plain, "quantized": quantized, "built_in": built_in}))
"""
# Teacher-forced along the float model's greedy paths (4 prompts x 6 steps), each step's top-20 logprobs
# compared on the tokens both runs list. The plugin's method is W8A8 with per-channel weight and per-token
# activation scales, the scheme of our built-in int8_dynamic: against it, the same logprobs up to float32
# rounding (tolerance 1e-3 nats). Against the float model: on this tiny random model (initializer_range 0.2,
# its top logprobs close together, so greedy paths part early) W8A8 moves a logprob by up to 0.33 nats
# (measured); the tolerance: 15 of the 20 tokens in common, the float model's next token among them, each
# within 0.5 nats.
SAME_SCHEME_TOLERANCE = 1e-3
FLOAT_TOLERANCE = 0.5


def largest_difference(ours, theirs, *, in_common):
    largest = 0.0
    for one, other in zip(ours, theirs, strict=True):
        common = one.keys() & other.keys()
        assert len(common) >= in_common and max(one, key=one.get) in common, (one, other)
        largest = max(largest, max(abs(one[t] - other[t]) for t in common))
    return largest


def test_the_vllm_style_int8_method_serves_close_to_the_float_model(ported, tiny_model, tmp_path):
    target, _ = ported
    record = tmp_path / "record.txt"
    model = tiny_model("llama")
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(model.path)], capture_output=True, text=True,
                            timeout=300, env=environment(target, DEEP_RECORD=str(record)))
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert sum(line.startswith("quantized") for line in record.read_text().splitlines()) == 8  # every linear layer
    assert largest_difference(out["built_in"], out["quantized"], in_common=18) < SAME_SCHEME_TOLERANCE
    from_float = largest_difference(out["plain"], out["quantized"], in_common=15)
    assert 0.0 < from_float < FLOAT_TOLERANCE, from_float  # in effect (the logprobs moved), and close
