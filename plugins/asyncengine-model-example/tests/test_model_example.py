"""The plugin's registration and its model class, in a fresh interpreter (registering changes the
process-wide ModelRegistry, which the other tests of this session must not see)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ae_model_example

SRC = Path(__file__).resolve().parent.parent / "src"

SCRIPT = r"""
import json, os
import torch
import transformers
from ae_model_example import register
from asyncengine.models.llama import LlamaForCausalLM
from asyncengine.interfaces.models import ModelRegistry
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.plugin_runtime.platform_resolution import set_current_platform
from asyncengine.plugin_runtime.records import StartupTrace

assert not ModelRegistry.is_supported("ExampleLlamaForCausalLM")
register()
register()  # a second call (a second engine in the process) is a no-op
entry = ModelRegistry.get("ExampleLlamaForCausalLM")
registered_lazily = entry.implementation
import sys
model_imported_by_register = "ae_model_example.model" in sys.modules
architecture, cls = ModelRegistry.resolve(["ExampleLlamaForCausalLM"])
StartupTrace("worker rank 0")  # no engine runs here: stand in for a worker's role
set_current_platform(CpuPlatform)
config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = cls(config, dtype=torch.float32, max_position=64)
reference = LlamaForCausalLM(config, dtype=torch.float32, max_position=64)
print(json.dumps({
    "lazy": registered_lazily, "owner": entry.owner, "imported_by_register": model_imported_by_register,
    "architecture": architecture, "subclass": issubclass(cls, LlamaForCausalLM),
    "same_parameters": sorted((n, tuple(p.shape)) for n, p in model.named_parameters())
                       == sorted((n, tuple(p.shape)) for n, p in reference.named_parameters()),
}))
"""


def test_register_adds_the_architecture_lazily_and_the_class_records_its_construction(tmp_path):
    record = tmp_path / "record.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               AE_PLUGIN_RECORD=str(record))
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "lazy": "ae_model_example.model:ExampleLlamaForCausalLM", "owner": "the calling script",
        "imported_by_register": False, "architecture": "ExampleLlamaForCausalLM", "subclass": True,
        "same_parameters": True,
    }
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) == 1  # the built-in reference records nothing; the example once, at construction
    assert {k: lines[0][k] for k in ("plugin", "event", "role", "cls")} == {
        "plugin": "ae_model_example", "event": "built", "role": "worker rank 0",
        "cls": "ae_model_example.model:ExampleLlamaForCausalLM"}
    assert lines[0]["pid"] != os.getpid()


def test_the_names_it_registers():
    assert ae_model_example.ARCHITECTURE == "ExampleLlamaForCausalLM"
    assert ae_model_example.MODEL_CLASS == "ae_model_example.model:ExampleLlamaForCausalLM"
