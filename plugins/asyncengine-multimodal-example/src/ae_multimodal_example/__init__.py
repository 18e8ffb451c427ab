"""An out-of-tree vision-language model, registered by a general plugin: the architecture
`ExampleLlavaForConditionalGeneration` (ModelRegistry, R1), whose class carries its input processing
(MULTIMODAL_REGISTRY.register_processor, R14).

    [project.entry-points."asyncengine.general_plugins"]
    ae_multimodal_example = "ae_multimodal_example:register"

Every process (frontend, engine core, each worker) calls `register()` in its general-plugins phase. The class is
registered as a "pkg.mod:Class" path: registering imports neither torch nor the model. The frontend imports the
module when it sets up image processing (the model's config.json has a `vision_config`), each worker when it
builds the model; the class's decorator registers its processor in each of them, attributed to this plugin.

This module imports only asyncengine.plugins_api, as every plugin should.
"""

from __future__ import annotations

from asyncengine.plugins_api import ModelRegistry

__all__ = ["ARCHITECTURE", "MODEL_CLASS", "register"]

ARCHITECTURE = "ExampleLlavaForConditionalGeneration"
MODEL_CLASS = "ae_multimodal_example.model:ExampleLlavaForConditionalGeneration"


def register() -> None:
    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
