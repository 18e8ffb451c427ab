"""vLLM's multimodal dummy plugin, in its shape (tests/plugins/vllm-shaped-llava: a general plugin registering, by a
lazy "module:Class" path, a LLaVA subclass whose logits always pick token 0, with LLaVA's processor registered on
the subclass through MULTIMODAL_REGISTRY), ported by `plugins port` alone and run as vLLM's
test_oot_registration_multimodal runs it: two `multi_modal_data` prompts, greedy, and nothing but the first
token generated. The hub's LLaVA is a tiny random one with its real processor (tests/support/vision_models.py),
its config naming the plugin's architecture. One engine for the module, started by a script with the ported
distribution on its PYTHONPATH, its worker in a process of its own (distributed_executor_backend="mp"), as vLLM's
engine core is.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.mm_processors import default_tokenizer
from support.vision_models import build_llava
from support.vllm_shaped import environment, port_and_install

# vLLM's test, with what this engine's CPU run needs instead of its GPU options (kv_cache_memory_bytes for
# gpu_memory_utilization=0.98) and the tiny model's context (1024) for llava-1.5's 4096, plus what the checks below read back: the tokens, the prompts' tokens, the
# worker's model class and the frontend's processor entry.
SCRIPT = r"""
import json, os, sys

import numpy as np
from PIL import Image

from asyncengine import LLM, SamplingParams
from asyncengine.plugins_api import MULTIMODAL_REGISTRY

image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)).convert("RGB")
prompts = [{"prompt": "What's in the image?<image>", "multi_modal_data": {"image": image}},
           {"prompt": "Describe the image<image>", "multi_modal_data": {"image": image}}]
with LLM(model=sys.argv[1], load_format="dummy", max_num_seqs=1, trust_remote_code=True, max_model_len=1024,
         enforce_eager=True, limit_mm_per_prompt={"image": 1}, kv_cache_memory_bytes=4 * 2**20,
         distributed_executor_backend="mp") as llm:
    first_token = llm.get_tokenizer().decode(0)
    outputs = llm.generate(prompts, SamplingParams(temperature=0))
    (worker,) = llm.collective_rpc("describe")
entry = MULTIMODAL_REGISTRY.get("vllm_shaped_llava.my_llava:MyLlava")
print(json.dumps({
    "first_token": first_token,
    "texts": [output.outputs[0].text for output in outputs],
    "tokens": [list(output.outputs[0].token_ids) for output in outputs],
    "prompt_tokens": [list(output.prompt_token_ids) for output in outputs],
    "worker": {"model_class": worker["model_class"], "architecture": worker["architecture"], "pid": worker["pid"]},
    "script_pid": os.getpid(),
    "processor": entry.implementation.processor.__name__ if entry is not None else None,
}))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-shaped-llava")
    target, report = port_and_install("vllm-shaped-llava", root)
    tokenizer_dir = root / "tokenizer"
    default_tokenizer().save_pretrained(str(tokenizer_dir))
    vlm = build_llava(root / "my-llava", tokenizer_dir)
    config = json.loads((vlm.path / "config.json").read_text())
    config["architectures"] = ["MyLlava"]
    (vlm.path / "config.json").write_text(json.dumps(config))
    script = root / "script.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(vlm.path)], capture_output=True, text=True,
                            timeout=300, env=environment(target))
    assert result.returncode == 0, result.stderr[-4000:]
    alone = vlm.processor(text=["<image>"], images=[_an_image()])["input_ids"][0]
    return json.loads(result.stdout.strip().splitlines()[-1]), report, vlm.image_token_id, list(alone).count(
        vlm.image_token_id)


def _an_image():
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.zeros((48, 64, 3), dtype=np.uint8))


def test_the_port_tool_maps_every_use_of_the_plugin():
    # (the fixture's port_and_install already requires it; here the rewrites the LLaVA classes take are named)
    from support.vllm_shaped import PLUGINS, port

    report = port(PLUGINS / "vllm-shaped-llava", write=False).stdout
    assert "from asyncengine.plugins_api import LlavaDummyInputsBuilder, LlavaForConditionalGeneration, " \
           "LlavaMultiModalProcessor, LlavaProcessingInfo" in report, report
    assert "0 use(s) cannot be mapped" in report, report


@pytest.mark.extension_point("R1", "R14")
def test_the_ported_plugins_llava_generates_only_the_first_token(run):
    result, _, image_token_id, tokens_per_image = run
    # vLLM's check: nothing but the first token in the text
    assert [text.replace(result["first_token"], "") for text in result["texts"]] == ["", ""]
    # and, stronger: 16 tokens (SamplingParams' default), each of them token 0 (not an early stop)
    assert result["tokens"] == [[0] * 16, [0] * 16]
    # the plugin's class is the model the worker built and ran, in a process of its own (where the general plugin
    # registered the lazy path again, and the worker imported it)
    assert result["worker"]["model_class"] == "vllm_shaped_llava.my_llava:MyLlava"
    assert result["worker"]["architecture"] == "MyLlava" and result["worker"]["pid"] != result["script_pid"]
    # MyLlava's own registration (R14) is in the frontend's registry (its decorator ran when the lazy path was
    # imported), and its processor expanded each prompt's one <image> into one token per patch
    assert result["processor"] == "LlavaMultiModalProcessor"
    assert [prompt.count(image_token_id) for prompt in result["prompt_tokens"]] == [tokens_per_image] * 2
    assert tokens_per_image > 1
