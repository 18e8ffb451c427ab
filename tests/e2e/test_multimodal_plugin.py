"""A multimodal model from a plugin (issue 38's extension point, row R14): the first-party distribution
plugins/asyncengine-multimodal-example, installed as a real distribution into a temporary target, registers
`ExampleLlavaForConditionalGeneration` (ModelRegistry, R1), a LLaVA subclass whose class carries its own input
processing (MULTIMODAL_REGISTRY.register_processor: processor, info, dummy inputs). In an engine whose worker runs
in a process of its own (distributed_executor_backend="mp"), the frontend processes the images with the plugin's
processor, the worker builds the plugin's model and profiles its vision encoder with the plugin's dummy inputs (its
start-up record names them and the plugin), and the tokens are the built-in LLaVA's with the same weights, for
prompts of one and two images. A multimodal class with no registration, reaching the worker through
model_class_overrides, fails the worker's start-up naming the class and the process. The model is a tiny random
LLaVA with its real processor (tests/support/vision_models.py); one script runs the three engines.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from asyncengine.plugin_runtime.records import read_trace
from support.mm_processors import default_tokenizer
from support.vision_models import build_llava

DIST, PLUGIN, ARCH = "asyncengine-multimodal-example", "ae_multimodal_example", "ExampleLlavaForConditionalGeneration"
KEY = "ae_multimodal_example.model:ExampleLlavaForConditionalGeneration"
OWNER = f"plugin {PLUGIN!r} ({DIST})"

# LLaVA's class copied, not subclassed: a multimodal class whose MRO has no registration.
BARE = """
from asyncengine.plugins_api import LlavaForConditionalGeneration as Llava

BareLlava = type("BareLlava", Llava.__bases__, {**{k: v for k, v in vars(Llava).items()
                                                   if k not in ("__dict__", "__weakref__")},
                                               "__module__": __name__, "__qualname__": "BareLlava"})
"""

SCRIPT = "BARE = " + repr(BARE) + r"""
import json, os, sys
import numpy as np
from PIL import Image
from asyncengine import LLM, SamplingParams
from asyncengine.plugins_api import MULTIMODAL_REGISTRY

example, builtin, directory = sys.argv[1:4]
rng = np.random.default_rng(0)
pictures = [Image.fromarray(rng.integers(0, 255, (100, 70, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 255, (40, 90, 3), dtype=np.uint8))]
prompts = [{"prompt": "Look <image> and say", "multi_modal_data": {"image": pictures[0]}},
           {"prompt": "<image> then <image>: which one?", "multi_modal_data": {"image": pictures}}]
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
options = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=4 * 2**20, enforce_eager=True)
result = {"pid": os.getpid()}
os.environ["AE_PLUGIN_RECORD"] = os.path.join(directory, "record.jsonl")
with LLM(example, distributed_executor_backend="mp",  # the worker in a process of its own
         startup_trace=os.path.join(directory, "trace.json"), **options) as llm:
    result["example"] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    (worker,) = llm.collective_rpc("describe")
    result["worker"] = {"model_class": worker["model_class"], "pid": worker["pid"]}
    try:  # the plugin's processing info allows 2 images per prompt
        llm.generate({"prompt": "<image><image><image>", "multi_modal_data": {"image": pictures + pictures[:1]}}, params)
    except Exception as exc:
        result["three_images"] = f"{type(exc).__name__}: {exc}"
del os.environ["AE_PLUGIN_RECORD"]
result["owners"] = MULTIMODAL_REGISTRY.owners()
with LLM(builtin, **options) as llm:
    result["builtin"] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
# A multimodal class with no registration, reaching the worker through model_class_overrides (the frontend does
# not import it): the worker's start-up fails, naming the class and the process.
with open(os.path.join(directory, "ae_bare_llava.py"), "w") as module:
    module.write(BARE)
os.environ["PYTHONPATH"] = directory + os.pathsep + os.environ["PYTHONPATH"]
sys.path.insert(0, directory)
try:
    with LLM(builtin, distributed_executor_backend="mp",
             model_class_overrides={"LlavaForConditionalGeneration": "ae_bare_llava:BareLlava"}, **options):
        result["unregistered"] = "started"
except Exception as exc:
    result["unregistered"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(result))
"""


def run(root, plugin_env):
    tokenizer_dir = root / "tokenizer"
    default_tokenizer().save_pretrained(str(tokenizer_dir))
    builtin = build_llava(root / "llava", tokenizer_dir).path
    example = root / "example-llava"  # the same weights and processor, under the plugin's architecture
    shutil.copytree(builtin, example)
    config = json.loads((example / "config.json").read_text())
    config["architectures"] = [ARCH]
    (example / "config.json").write_text(json.dumps(config))
    script = root / "user_script.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(example), str(builtin), str(root)], capture_output=True,
                          text=True, env=plugin_env(DIST), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (root / "record.jsonl").read_text().splitlines()]
    return json.loads(done.stdout.strip().splitlines()[-1]), records, read_trace(root / "trace.json")


@pytest.mark.extension_point("R1", "R14")
def test_the_plugins_model_runs_with_its_processing_in_the_frontend_and_the_worker(tmp_path, plugin_env):
    result, records, trace = run(tmp_path, plugin_env)
    # Greedy tokens identical to the built-in LLaVA with the same weights, for one image and two of different sizes.
    assert result["example"] == result["builtin"] and len(result["example"]) == 2
    assert all(len(tokens) == 8 for tokens in result["example"])
    # The worker, in a process of its own, built the plugin's class.
    assert result["worker"]["model_class"] == KEY and result["worker"]["pid"] != result["pid"]
    by_event: dict[str, list[dict]] = {}
    for line in records:
        by_event.setdefault(line["event"], []).append(line)
    assert [(r["role"], r["pid"]) for r in by_event["model built"]] == [("worker rank 0", result["worker"]["pid"])]
    # Its processor was built in the frontend (the script's process: images) and in the worker (profiling).
    assert sorted((r["role"], r["pid"]) for r in by_event["processor built"]) == [
        ("frontend", result["pid"]), ("worker rank 0", result["worker"]["pid"])]
    # Its dummy inputs: one image in the frontend's start-up check, the most per prompt (2, its info's limit) at
    # max_model_len in the worker's profile.
    assert sorted((r["role"], r["images"], r["seq_len"]) for r in by_event["dummy inputs"]) == [
        ("frontend", 1, 0), ("worker rank 0", 2, 512)]
    # The worker's start-up report names the processing and the plugin; the encoder ran on the 2 dummy images.
    (profile,) = [r for r in trace if r.plugin == "multimodal profile"]
    assert profile.role == "worker rank 0" and profile.phase == "kv cache" and profile.outcome == "ok"
    assert profile.reason.startswith(
        "ae_multimodal_example.model:ExampleMultiModalProcessor with dummy inputs "
        f"ae_multimodal_example.model:ExampleDummyInputsBuilder (registered by {OWNER}): 2 image(s) per prompt, "
        "at most 16 embedding rows per image"), profile.reason
    assert "the vision encoder ran on 2 image(s)" in profile.reason
    # The info's limit holds in the frontend: a third image is refused.
    assert result["three_images"].startswith("RequestError: ") and \
        "3 images in one prompt, over the limit of 2" in result["three_images"], result["three_images"]
    # Who registered what, in the frontend: the plugin its class's processing (imported lazily, from its
    # ModelRegistry entry), the engine the built-in LLaVA's that the plugin's module imported first.
    assert result["owners"][KEY] == OWNER
    assert result["owners"]["asyncengine.models.llava:LlavaForConditionalGeneration"] == "built-in"
    # A multimodal class with no registration visible in the worker: start-up fails there, naming class and process.
    assert re.search(r"multimodal model class ae_bare_llava:BareLlava has no processor registered in "
                     r"'multimodal_processors' \(MULTIMODAL_REGISTRY\) in the worker rank 0 \(pid \d+\)",
                     result["unregistered"]), result["unregistered"]
