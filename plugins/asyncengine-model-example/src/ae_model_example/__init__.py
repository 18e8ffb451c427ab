"""An out-of-tree model architecture, `ExampleLlamaForCausalLM`, registered by a general plugin.

    [project.entry-points."asyncengine.general_plugins"]
    ae_model_example = "ae_model_example:register"

Every process (frontend, engine core, each worker) calls `register()` in its general-plugins phase.
The class is registered lazily, as "ae_model_example.model:ExampleLlamaForCausalLM": registering
imports neither torch nor the model; the frontend imports the class when it checks config.json's
architecture, and each worker when it builds the model.

This module imports only asyncengine.plugins_api, as every plugin should.
"""

from __future__ import annotations

from asyncengine.plugins_api import ModelRegistry

__all__ = ["ARCHITECTURE", "MODEL_CLASS", "register"]

ARCHITECTURE = "ExampleLlamaForCausalLM"
MODEL_CLASS = "ae_model_example.model:ExampleLlamaForCausalLM"


def register() -> None:
    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
