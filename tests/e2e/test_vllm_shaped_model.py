"""A model plugin written as vLLM's tests/plugins/vllm_add_dummy_model is (tests/plugins/vllm-shaped-model:
a general plugin registering a Llama subclass whose logits always pick token 0), ported by `plugins
port` alone, plus the smaller vLLM contracts around it:
- `load_general_plugins()` (public, in plugins_api) registers it in a process that starts no engine;
- with the plugin, a model of that architecture generates only token 0;
- with no plugins allowed (ASYNCENGINE_PLUGINS=""), the architecture is refused with a ValueError;
- a prompt with multi_modal_data is a RequestError naming the field (never ignored silently).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from support.vllm_shaped import environment, port_and_install

SCRIPT = r"""
import json, sys
from asyncengine import LLM, SamplingParams
from asyncengine.errors import RequestError
from asyncengine.plugins_api import ModelRegistry, load_general_plugins

model, options = sys.argv[1], json.loads(sys.argv[2])
result = {}
if options.pop("load_first", False):
    result["loaded"] = load_general_plugins()
    result["registered"] = "MyLlamaForCausalLM" in ModelRegistry.get_supported_archs()
try:
    with LLM(model, skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=2**20, **options) as llm:
        (output,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=4,
                                                                                  ignore_eos=True))
        result["tokens"] = list(output.outputs[0].token_ids)
        try:
            llm.generate([{"prompt_token_ids": [5, 6], "multi_modal_data": {"image": "cherry.png"}}])
        except RequestError as exc:
            result["multimodal"] = [exc.field, str(exc)]
except ValueError as exc:
    result["error"] = [type(exc).__name__, str(exc)]
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def shaped(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("vllm-shaped-model")
    target, report = port_and_install("vllm-shaped-model", root)
    model = root / "my-llama"
    shutil.copytree(tiny_model("llama").path, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["MyLlamaForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    return target, report, model


def run(shaped, tmp_path, options, **env):
    target, _, model = shaped
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(model), json.dumps(options)], capture_output=True,
                            text=True, timeout=300, env=environment(target, **env))
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.extension_point("E1", "R1")
def test_the_registered_model_generates_only_token_zero(shaped, tmp_path):
    # (In-process: registrations reaching other processes are the manifest check's, tested elsewhere.)
    assert "0 use(s) cannot be mapped" in shaped[1]
    result = run(shaped, tmp_path, {"load_first": True})
    assert result["tokens"] == [0, 0, 0, 0]
    assert result["loaded"] == ["register_shaped_model"] and result["registered"] is True
    assert result["multimodal"][0] == "multi_modal_data"
    assert "multi_modal_data is not supported" in result["multimodal"][1]


def test_without_plugins_the_architecture_is_a_value_error(shaped, tmp_path):
    result = run(shaped, tmp_path, {}, ASYNCENGINE_PLUGINS="")
    name, message = result["error"]
    assert name == "UnsupportedArchitectureError"
    assert "model architecture(s) MyLlamaForCausalLM of" in message and "are not supported for now" in message  # vLLM matches this
