"""A model family from outside asyncengine, registered by a general plugin: an architecture,
`ExampleLlamaForCausalLM` (ModelRegistry, R1), its weight format `example_npz` (ModelLoaderRegistry,
R5) and its tokenizer mode `example_bytes` (TokenizerRegistry, R9).

    [project.entry-points."asyncengine.general_plugins"]
    ae_model_example = "ae_model_example:register"

Every process (frontend, engine core, each worker) calls `register()` in its general-plugins phase.
Everything is registered lazily, as "pkg.mod:Class" paths: registering imports neither torch nor the
model; the frontend imports the model class when it checks config.json's architecture and the tokenizer
class when it builds the tokenizer, and each worker imports the model and loader classes when it builds
the model.

This module imports only asyncengine.plugins_api, as every plugin should.
"""

from __future__ import annotations

from asyncengine.plugins_api import ModelLoaderRegistry, ModelRegistry, TokenizerRegistry

__all__ = ["ARCHITECTURE", "LOADER_CLASS", "MODEL_CLASS", "TOKENIZER_CLASS", "register"]

ARCHITECTURE = "ExampleLlamaForCausalLM"
MODEL_CLASS = "ae_model_example.model:ExampleLlamaForCausalLM"
LOADER_CLASS = "ae_model_example.loader:ExampleNpzLoader"
TOKENIZER_CLASS = "ae_model_example.tokenizer:ExampleByteTokenizer"


def register() -> None:
    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    ModelLoaderRegistry.register_loader("example_npz", LOADER_CLASS)
    TokenizerRegistry.register("example_bytes", TOKENIZER_CLASS)
