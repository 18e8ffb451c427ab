"""Registries that plugins fill, and which process reads each (EXTENSION_POINTS.md, "reads it").

The manifest check compares, in each child process, the registries its role reads with the
frontend's: a key the frontend has and the child lacks fails start-up there, naming it.
"""

from __future__ import annotations

from asyncengine.interfaces.registry import BUILT_IN, Registry, RegistrationError, current_registrant
from asyncengine.interfaces.roles import ENGINE_CORE, FRONTEND, WORKER


def all_registries() -> dict[str, tuple[Registry, frozenset[str]]]:
    """Registry name -> (registry, the roles that read it)."""
    from asyncengine.attention.registry import AttentionBackendRegistry
    from asyncengine.frontend.tokenizer import TokenizerRegistry
    from asyncengine.kv_transfer.factory import KVConnectorFactory
    from asyncengine.plugin_runtime.additional_config import AdditionalConfigRegistry
    from asyncengine.loader.registry import ModelLoaderRegistry
    from asyncengine.models.layers.op_registry import CustomOpRegistry, OpProviderRegistry
    from asyncengine.models.layers.quantization import QuantizationRegistry
    from asyncengine.models.registry import ModelRegistry
    from asyncengine.server.parsers import ReasoningParserManager, ToolParserManager
    from asyncengine.structured_output.registry import StructuredOutputBackendRegistry

    return {
        ModelRegistry.name: (ModelRegistry, frozenset({FRONTEND, WORKER})),
        # The worker builds with it; the frontend checks the --load-format name before anything starts.
        ModelLoaderRegistry.name: (ModelLoaderRegistry, frozenset({FRONTEND, WORKER})),
        ToolParserManager.name: (ToolParserManager, frozenset({FRONTEND})),
        ReasoningParserManager.name: (ReasoningParserManager, frozenset({FRONTEND})),
        # --tokenizer-mode: the frontend tokenizes prompts and detokenizes outputs; no other process does.
        TokenizerRegistry.name: (TokenizerRegistry, frozenset({FRONTEND})),
        # additional_config keys: the frontend checks each key is claimed before anything is spawned.
        AdditionalConfigRegistry.name: (AdditionalConfigRegistry, frozenset({FRONTEND})),
        # The worker builds the model's custom ops (and their out-of-tree replacements) and runs their providers.
        CustomOpRegistry.name: (CustomOpRegistry, frozenset({WORKER})),
        OpProviderRegistry.name: (OpProviderRegistry, frozenset({WORKER})),
        # The worker builds each layer's backend with it (the platform or attention_backend names one).
        AttentionBackendRegistry.name: (AttentionBackendRegistry, frozenset({WORKER})),
        # The worker builds the linear layers with it; the frontend checks the `quantization` name first.
        QuantizationRegistry.name: (QuantizationRegistry, frozenset({FRONTEND, WORKER})),
        # The engine core builds the connector's scheduler side with it, each worker its worker side.
        KVConnectorFactory.name: (KVConnectorFactory, frozenset({ENGINE_CORE, WORKER})),
        # The engine core compiles grammars and computes masks with it; the frontend checks each grammar first.
        StructuredOutputBackendRegistry.name: (StructuredOutputBackendRegistry, frozenset({FRONTEND, ENGINE_CORE})),
    }


# The modules whose functions read a registry or a config hook (marked with `reads`): imported to draw `plugins map`.
READER_MODULES = (
    "asyncengine.config.model",
    "asyncengine.engine_core.core",
    "asyncengine.engine_core.executor",
    "asyncengine.plugin_runtime.phases",
    "asyncengine.plugin_runtime.additional_config",
    "asyncengine.plugin_runtime.contracts",
    "asyncengine.worker.extension",
    "asyncengine.worker.worker",
    "asyncengine.frontend.startup",
    "asyncengine.frontend.tokenizer",
    "asyncengine.loader.model_loader",
    "asyncengine.interfaces.model_loader",
    "asyncengine.models.layers.op_registry",
    "asyncengine.server.app",
    "asyncengine.attention.selector",
    "asyncengine.kv_transfer.factory",
    "asyncengine.structured_output.registry",
)


__all__ = ["BUILT_IN", "ENGINE_CORE", "FRONTEND", "READER_MODULES", "WORKER", "Registry", "RegistrationError",
           "all_registries", "current_registrant"]
