"""A model written as vLLM's model files are (tests/plugins/vllm-shaped-layers: QKVParallelLinear,
MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ParallelLMHead, RMSNorm, get_rope, Attention,
a `load_weights` that sends every checkpoint tensor through its parameter's `weight_loader`, with shard ids for the
fused layers), registered with vLLM's `ModelRegistry.register_model` from a general plugin, ported by `plugins port`
alone: on the tiny random Llama it generates transformers' greedy tokens in-process, with the engine core and the
worker in processes of their own, and with two tensor-parallel ranks (the weight loaders splitting the tensors)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from support.hf_reference import hf_greedy
from support.parity_runs import prompts_for
from support.vllm_shaped import environment, port_and_install

NUM_TOKENS = 8

SCRIPT = r"""
import json, sys
from asyncengine import LLM, SamplingParams

model, prompts = sys.argv[1], json.loads(sys.argv[2])
runs = {"in-process": {}, "multiprocess": {"in_process": False, "distributed_executor_backend": "mp"},
        "tp2": {"in_process": False, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}}
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True)
result = {}
for label, options in runs.items():
    with LLM(model, skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=4 * 2**20, dtype="float32",
             **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        result[label] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                         "workers": [[d["rank"], d["pid"], d["model_class"]] for d in llm.collective_rpc("describe")]}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def shaped(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("vllm-shaped-layers")
    target, report = port_and_install("vllm-shaped-layers", root)
    llama = tiny_model("llama")
    model = root / "shaped-llama"
    shutil.copytree(llama.path, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["ShapedLlamaForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    return target, report, model, llama


@pytest.mark.extension_point("E1", "R1")
def test_the_vllm_shaped_model_matches_transformers_in_process_multiprocess_and_at_tp2(shaped, tmp_path):
    target, report, model, llama = shaped
    assert "0 use(s) cannot be mapped" in report, report
    prompts = prompts_for(llama.vocab_size, seed=33, lengths=(3, 21, 40))
    expected = [hf_greedy(llama.hf_model, prompt, NUM_TOKENS).token_ids for prompt in prompts]
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(model), json.dumps(prompts), str(NUM_TOKENS)],
                            capture_output=True, text=True, timeout=480, env=environment(target))
    assert result.returncode == 0, result.stderr[-4000:]
    runs = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(runs) == {"in-process", "multiprocess", "tp2"}
    for label, run in runs.items():
        assert run["tokens"] == expected, label
        # the plugin's class ran (vLLM's constructor and forward, through the engine's adapter), in each rank
        assert {worker[2] for worker in run["workers"]} == {"vllm_shaped_layers.model:ShapedLlamaForCausalLM"}
    assert [worker[0] for worker in runs["tp2"]["workers"]] == [0, 1]
    assert len({worker[1] for worker in runs["tp2"]["workers"]}) == 2  # one process per rank
