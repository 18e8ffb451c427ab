"""Every registry plugins fill, and which process roles read each (docs/reference.md, "reads it").

The manifest check compares, in each child process, the registries its role reads with the frontend's:
a key the frontend has and the child lacks fails start-up there, naming it. `plugins map` and the
start-up timeline draw from the same table.

Every table lives in this package, next to the interface its entries implement. Where an entry's code
belongs to a higher layer (the built-in parsers, the "auto" tokenizer mode, the op providers and the
in-tree custom ops), the floor registers it by "pkg.mod:attr" path, imported when first used; the
behaviour that reads the table (the op providers' per-call choice, the parsers' plugin files, the
tokenizer loading, the additional_config check) stays in that layer.
"""

from __future__ import annotations

from typing import Any

from asyncengine.interfaces.additional_config import AdditionalConfigRegistry
from asyncengine.interfaces.attention import AttentionBackendRegistry
from asyncengine.interfaces.custom_op_registry import CustomOpRegistry, OpProviderRegistry
from asyncengine.interfaces.kv_connector import KVConnectorFactory
from asyncengine.interfaces.lora_resolver import LoRAResolverRegistry
from asyncengine.interfaces.model_loader import ModelLoaderRegistry
from asyncengine.interfaces.models import ModelRegistry
from asyncengine.interfaces.multimodal_registry import MULTIMODAL_REGISTRY
from asyncengine.interfaces.parsers import ReasoningParserManager, ToolParserManager
from asyncengine.interfaces.pooler import PoolerRegistry
from asyncengine.interfaces.quantization import QuantizationRegistry
from asyncengine.interfaces.registry import Registry
from asyncengine.interfaces.roles import ENGINE_CORE, FRONTEND, WORKER
from asyncengine.interfaces.spec_decode import ProposerRegistry
from asyncengine.interfaces.structured_output import StructuredOutputBackendRegistry
from asyncengine.interfaces.tokenizer import TokenizerRegistry

# Registry -> the roles that read it, in the order the manifest and the map list them.
_TABLES: tuple[tuple[Registry[Any], frozenset[str]], ...] = (
    (ModelRegistry, frozenset({FRONTEND, WORKER})),
    # The worker builds with it; the frontend checks the --load-format name before anything starts.
    (ModelLoaderRegistry, frozenset({FRONTEND, WORKER})),
    (ToolParserManager, frozenset({FRONTEND})),
    # The frontend splits reasoning from content; the engine core starts a constraint after the reasoning.
    (ReasoningParserManager, frozenset({FRONTEND, ENGINE_CORE})),
    # --tokenizer-mode: the frontend tokenizes prompts and detokenizes outputs; no other process does.
    (TokenizerRegistry, frozenset({FRONTEND})),
    # additional_config keys: the frontend checks each key is claimed before anything is spawned.
    (AdditionalConfigRegistry, frozenset({FRONTEND})),
    # The worker builds the model's custom ops (and their out-of-tree replacements) and runs their providers.
    (CustomOpRegistry, frozenset({WORKER})),
    (OpProviderRegistry, frozenset({WORKER})),
    # The worker builds each layer's backend with it (the platform or attention_backend names one).
    (AttentionBackendRegistry, frozenset({WORKER})),
    # The worker builds the linear layers with it; the frontend checks the `quantization` name first.
    (QuantizationRegistry, frozenset({FRONTEND, WORKER})),
    # The engine core builds the connector's scheduler side with it, each worker its worker side.
    (KVConnectorFactory, frozenset({ENGINE_CORE, WORKER})),
    # The engine core compiles grammars and computes masks with it; the frontend checks each grammar first.
    (StructuredOutputBackendRegistry, frozenset({FRONTEND, ENGINE_CORE})),
    # The worker builds a pooling model's pooler with it (--pooler-config names one; docs/pooling.md).
    (PoolerRegistry, frozenset({WORKER})),
    # A request naming an unknown adapter asks the resolvers, in the frontend only (frontend/lora.py).
    (LoRAResolverRegistry, frozenset({FRONTEND})),
    # speculative_config's method: the frontend checks the name, the worker builds the proposer (R13).
    (ProposerRegistry, frozenset({FRONTEND, WORKER})),
    # A multimodal model class's processor (R14): the frontend processes images with it. Filled when the model's
    # module is imported (the decorator), so a child that has not imported it yet would lack the key: the
    # worker's reading (profiling) is checked where it builds the model, not by the manifest.
    (MULTIMODAL_REGISTRY, frozenset({FRONTEND})),
)


def all_registries() -> dict[str, tuple[Registry[Any], frozenset[str]]]:
    """Registry name -> (registry, the roles that read it)."""
    return {registry.name: (registry, roles) for registry, roles in _TABLES}


# The modules whose functions read a registry or a config hook (marked with `reads`): imported to draw
# `plugins map`.
READER_MODULES = (
    "asyncengine.engine_core.core",
    "asyncengine.engine_core.executor",
    "asyncengine.plugin_runtime.phases",
    "asyncengine.plugin_runtime.additional_config",
    "asyncengine.plugin_runtime.contracts",
    "asyncengine.worker.build",
    "asyncengine.worker.extension",
    "asyncengine.worker.spec_decode.verifier",
    "asyncengine.worker.worker",
    "asyncengine.frontend.startup",
    "asyncengine.frontend.speculative",
    "asyncengine.frontend.lora",
    "asyncengine.frontend.tokenizer",
    "asyncengine.frontend.multimodal",
    "asyncengine.loader.model_loader",
    "asyncengine.interfaces.model_loader",
    "asyncengine.interfaces.pooler",
    "asyncengine.interfaces.spec_decode",
    "asyncengine.interfaces.quantization",
    "asyncengine.interfaces.custom_op_registry",
    "asyncengine.models.layers.op_registry",
    "asyncengine.server.parsers.selection",
    "asyncengine.attention.selector",
    "asyncengine.compat.attention_selector",  # vLLM's older selector, for plugin tests
    "asyncengine.kv_transfer.factory",
    "asyncengine.structured_output.registry",
    "asyncengine.structured_output.reasoning",
)


__all__ = ["READER_MODULES", "all_registries"]
