"""The plugin's registration, its processing classes and its model class, in a fresh interpreter (registering
changes the process-wide registries, which the other tests of this session must not see)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

SCRIPT = r"""
import json, sys
from types import SimpleNamespace
from ae_multimodal_example import ARCHITECTURE, register
from asyncengine.plugins_api import MULTIMODAL_REGISTRY, ModelRegistry

register()
register()  # a second call (a second engine in the process) is a no-op
entry = ModelRegistry.get(ARCHITECTURE)
imported_by_register = "ae_multimodal_example.model" in sys.modules
cls = ModelRegistry.load(ARCHITECTURE)  # imports the module: its decorator registers the processing
from ae_multimodal_example.model import (ExampleDummyInputsBuilder, ExampleMultiModalProcessor,
                                         ExampleProcessingInfo)
from asyncengine.plugins_api import LlavaForConditionalGeneration

factories = MULTIMODAL_REGISTRY.factories_for(cls)
key = "ae_multimodal_example.model:ExampleLlavaForConditionalGeneration"
info = ExampleProcessingInfo(ctx=None)
info.get_hf_processor = lambda: SimpleNamespace(image_processor=SimpleNamespace(crop_size={"height": 8, "width": 6}))
images = ExampleDummyInputsBuilder(info).get_dummy_mm_data(64, {"image": 2})["image"]
print(json.dumps({
    "lazy": entry.implementation, "imported_by_register": imported_by_register,
    "subclass": issubclass(cls, LlavaForConditionalGeneration),
    "factories": [factories.processor is ExampleMultiModalProcessor, factories.info is ExampleProcessingInfo,
                  factories.dummy_inputs is ExampleDummyInputsBuilder],
    "owners": MULTIMODAL_REGISTRY.owners(),
    "limits": info.get_supported_mm_limits(),
    "images": [[image.size, image.getpixel((0, 0))] for image in images],
}))
"""


def test_register_adds_the_architecture_lazily_and_its_class_carries_its_processing():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    for name in ("ASYNCENGINE_PLUGINS", "AE_PLUGIN_RECORD"):  # no engine runs here: nothing to record
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "lazy": "ae_multimodal_example.model:ExampleLlavaForConditionalGeneration", "imported_by_register": False,
        "subclass": True, "factories": [True, True, True],
        # the lazy entry's owner (here the script that called register()) owns what its module's import registered;
        # the built-in LLaVA, imported by it, stays built-in
        "owners": {"ae_multimodal_example.model:ExampleLlavaForConditionalGeneration": "the calling script",
                   "asyncengine.models.llava:LlavaForConditionalGeneration": "built-in"},
        "limits": {"image": 2},
        "images": [[[6, 8], [128, 128, 128]], [[6, 8], [128, 128, 128]]],
    }
