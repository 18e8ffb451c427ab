"""Model loaders (R5): the built-ins through the registry, a plugin's loader running in the worker
process, a frontend-only registration caught by the manifest check, an unknown --load-format."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from asyncengine.errors import ConfigError
from asyncengine.interfaces.model_loader import BaseModelLoader, ModelLoaderRegistry
from asyncengine.loader.registry import DummyLoader, GgufLoader, SafetensorsLoader, register_model_loader
from asyncengine.interfaces.registry import BUILT_IN, RegistrationError

OPTIONS = dict(skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20)


def test_the_built_ins_are_registered_in_code_as_built_in():
    assert ModelLoaderRegistry.owners() == {"dummy": BUILT_IN, "gguf": BUILT_IN, "safetensors": BUILT_IN}
    assert ModelLoaderRegistry.loader_class("auto") is SafetensorsLoader
    assert ModelLoaderRegistry.loader_class("gguf") is GgufLoader
    assert ModelLoaderRegistry.loader_class("dummy") is DummyLoader


def test_an_unknown_load_format_lists_the_known_loaders():
    with pytest.raises(ConfigError) as caught:
        ModelLoaderRegistry.loader_class("tensorizer")
    assert str(caught.value) == ("load_format 'tensorizer' names no model loader; known: auto, dummy, gguf, "
                                 "safetensors (a plugin adds one with register_model_loader)")
    assert caught.value.field == "load_format"


def test_replacing_a_built_in_needs_override():
    class Mine(BaseModelLoader):
        pass

    with pytest.raises(RegistrationError, match=r"model loader 'dummy' is already registered to .*DummyLoader "
                                                r"\(by built-in\)"):
        register_model_loader("dummy")(Mine)


def test_the_dummy_loader_gives_the_same_random_weights_for_a_seed(tiny_model):
    from asyncengine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = []
    for seed in (3, 3, 4):
        with LLM(str(tiny_model("llama").path), load_format="dummy", seed=seed, **OPTIONS) as llm:
            outputs.append(llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids)
    assert outputs[0] == outputs[1]
    assert outputs[0] != outputs[2]  # another seed, other weights


SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams
from asyncengine.errors import StartupError

model, load_format, register_here = sys.argv[1], sys.argv[2], sys.argv[3] == "register"
if register_here:
    from asyncengine.plugins_api import SafetensorsLoader, register_model_loader
    register_model_loader("script_only")(type("ScriptLoader", (SafetensorsLoader,), {}))
try:
    with LLM(model, in_process=False, distributed_executor_backend="mp", load_format=load_format,
             skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        tokens = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids
except StartupError as error:
    print(json.dumps({"error": type(error).__name__, "message": str(error)}))
else:
    print(json.dumps({"pid": os.getpid(), "tokens": list(tokens)}))
"""


def run_script(tmp_path, env, *args) -> dict:
    result = subprocess.run([sys.executable, "-c", SCRIPT, *args], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference_tokens(tiny_model):
    from asyncengine import LLM, SamplingParams

    with LLM(str(tiny_model("llama").path), **OPTIONS) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        return list(llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids)


def test_a_plugin_loader_builds_the_model_in_the_worker_process(tiny_model, plugin_env, tmp_path, reference_tokens):
    records = tmp_path / "records.jsonl"
    env = plugin_env("ae-plugin-loader", AE_PLUGIN_RECORD=str(records))
    outcome = run_script(tmp_path, env, str(tiny_model("llama").path), "ae_recording", "no")
    assert outcome["tokens"] == reference_tokens  # it read the checkpoint
    (record,) = [json.loads(line) for line in records.read_text().splitlines()]
    assert record["what"] == "model loader" and record["format"] == "ae_recording"
    assert record["role"] == "worker rank 0" and record["pid"] != outcome["pid"]


def test_a_loader_registered_only_in_the_script_is_caught_in_the_worker(tiny_model, plugin_env, tmp_path):
    outcome = run_script(tmp_path, plugin_env(), str(tiny_model("llama").path), "script_only", "register")
    assert outcome["error"] == "MissingRegistration"
    assert re.fullmatch(
        r"the worker rank 0 \(pid \d+\) failed in start-up phase 'manifest check': model loader 'script_only' is "
        r"missing from registry 'model_loaders' here, while the frontend \(pid \d+\) has it \(registered there by "
        r"the calling script\): .* register it from a general plugin .*", outcome["message"]), outcome["message"]


def test_an_unknown_load_format_fails_before_anything_starts(tiny_model, plugin_env, tmp_path):
    outcome = run_script(tmp_path, plugin_env(), str(tiny_model("llama").path), "tensorizer", "no")
    assert outcome["error"] == "ConfigError"
    assert "load_format 'tensorizer' names no model loader; known: auto, dummy, gguf, safetensors" in outcome["message"]
