"""The manifest: a registration that exists only in the frontend is caught where it is missing.

Each test runs a user's script in a fresh interpreter (so registrations cannot leak between tests),
with exactly the plugin distributions it needs on PYTHONPATH, and starts a real engine:
- a model registered by the script itself works in-process, and is caught at start-up in the worker
  process of a multiprocess engine, with the key, the registry, the process and the registrant named;
- the same model registered by a general plugin (a real installed distribution) serves from a
  multiprocess engine, built in the worker process.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import json, os, sys
from asyncengine import LLM, SamplingParams
from asyncengine.errors import StartupError
from asyncengine.plugins_api import ModelRegistry

model, register_here, placement = sys.argv[1], sys.argv[2] == "register", sys.argv[3]
if register_here:
    ModelRegistry.register_model("ScriptLlamaForCausalLM", "asyncengine.models.llama:LlamaForCausalLM")
options = dict(skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20)
if placement == "multiprocess":
    options.update(in_process=False, distributed_executor_backend="mp")
try:
    with LLM(model, **options) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        output = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params)[0].outputs[0].token_ids
        workers = llm.collective_rpc("describe")
except StartupError as error:
    print(json.dumps({"error": type(error).__name__, "message": str(error)}))
else:
    print(json.dumps({"pid": os.getpid(), "tokens": list(output), "workers": workers}))
"""


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def renamed(llama, tmp_path: Path, architecture: str) -> Path:
    """The tiny Llama checkpoint under another architecture name (config.json's `architectures`)."""
    directory = tmp_path / architecture
    shutil.copytree(llama.path, directory)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = [architecture]
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def reference_tokens(llama) -> list[int]:
    """The same prompt on the checkpoint under its own architecture name."""
    from asyncengine import LLM, SamplingParams

    with LLM(str(llama.path), skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        return list(llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params)[0].outputs[0].token_ids)


def run_script(tmp_path: Path, env: dict[str, str], *args: str) -> dict:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.extension_point("X", "G1")
def test_a_registration_made_only_in_the_frontend_is_caught_in_the_worker(llama, tmp_path, plugin_env):
    model = renamed(llama, tmp_path, "ScriptLlamaForCausalLM")
    outcome = run_script(tmp_path, plugin_env(), str(model), "register", "multiprocess")
    assert outcome["error"] == "MissingRegistration", outcome
    assert re.fullmatch(
        r"the worker rank 0 \(pid \d+\) failed in start-up phase 'manifest check': model architecture "
        r"'ScriptLlamaForCausalLM' is missing from registry 'models' here, while the frontend \(pid \d+\) has it "
        r"\(registered there by the calling script\): a registration made in one process does not reach the "
        r"others; register it from a general plugin \(entry-point group asyncengine.general_plugins\), which "
        r"every process loads",
        outcome["message"],
    ), outcome["message"]


def test_a_registration_made_by_the_calling_script_works_in_process(llama, tmp_path, plugin_env, reference_tokens):
    model = renamed(llama, tmp_path, "ScriptLlamaForCausalLM")
    outcome = run_script(tmp_path, plugin_env(), str(model), "register", "in-process")
    assert outcome["tokens"] == reference_tokens
    (worker,) = outcome["workers"]
    assert worker["pid"] == outcome["pid"]  # the worker is a thread of the script's own process
    assert worker["architecture"] == "ScriptLlamaForCausalLM"


def test_a_model_registered_by_a_general_plugin_is_built_in_the_worker_process(llama, tmp_path, plugin_env,
                                                                               reference_tokens):
    model = renamed(llama, tmp_path, "PluginLlamaForCausalLM")
    outcome = run_script(tmp_path, plugin_env("ae-plugin-general"), str(model), "no", "multiprocess")
    assert outcome["tokens"] == reference_tokens
    (worker,) = outcome["workers"]
    assert worker["pid"] != outcome["pid"]
    assert worker["architecture"] == "PluginLlamaForCausalLM"
    assert worker["model_class"] == "asyncengine.models.llama:LlamaForCausalLM"


def test_without_the_plugin_the_architecture_is_unknown_in_the_frontend(llama, tmp_path, plugin_env):
    model = renamed(llama, tmp_path, "PluginLlamaForCausalLM")
    outcome = run_script(tmp_path, plugin_env(), str(model), "no", "multiprocess")
    assert outcome["error"] in ("UnsupportedArchitectureError", "ConfigError"), outcome
    assert "PluginLlamaForCausalLM" in outcome["message"] and "not supported" in outcome["message"]
