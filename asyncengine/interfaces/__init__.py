"""The floor: every class a plugin subclasses or implements, the registry tables, `import_by_path` and
the role names.

Everything above it (the plugin runtime, the roles' code, the server and the CLI) imports these from here;
this package imports only asyncengine.config, asyncengine.errors and the floor's request types, and no
torch: the one torch-based module, interfaces.torch_bases (CustomOp), is imported when asked for.
Every name below is importable from the package (`from asyncengine.interfaces import Platform`).
Plugins keep importing from asyncengine.plugins_api, the public face, which re-exports what is here.

One module per concern, each with its table where it has one:

- platform: Platform, PlatformEnum
- attention: AttentionBackend, AttentionBackendRegistry
- io_processor, stat_logger, endpoint: IOProcessor, StatLoggerBase, EndpointPlugin (read in the frontend)
- logits: LogitsProcessor, BatchUpdate (AddedRequest, MovedRequest, MoveDirectionality)
- kv_connector: KVConnectorBase and its parts, KVConnectorFactory
- executor, worker, scheduler: Executor, WorkerBase, SchedulerInterface (read in the engine core)
- quantization: QuantizationConfig, LinearMethod, QuantizationRegistry
- model_loader, models: BaseModelLoader, LoadConfig, ModelLoaderRegistry; ModelRegistry
- structured_output: StructuredOutputBackend, GrammarMatcher, StructuredOutputBackendRegistry
- custom_op_registry, torch_bases: the custom-op tables; CustomOp
- parsers: ToolParser, ReasoningParser, the shapes they return, ToolParserManager, ReasoningParserManager
- tokenizer, additional_config: TokenizerRegistry (the tokenizer modes); AdditionalConfigRegistry
- registry, tables, imports, roles: the Registry type, every table and who reads it, import_by_path, the role names
"""

from __future__ import annotations

import importlib
from typing import Any

# Name -> the submodule that defines it. Imported when first asked for (PEP 562), not with the package:
# asyncengine.config imports asyncengine.interfaces.registry, which runs this file first, and the
# submodules import asyncengine.config back; the package itself stays empty until a name is read.
_WHERE = {
    "AdditionalConfigRegistry": "additional_config",
    "AttentionBackend": "attention", "AttentionBackendRegistry": "attention",
    "CustomOpRegistry": "custom_op_registry", "OpProviderRegistry": "custom_op_registry",
    "EndpointPlugin": "endpoint",
    "Executor": "executor",
    "ClassPathImportError": "imports", "import_by_path": "imports",
    "IOProcessor": "io_processor",
    "KVConnectorBase": "kv_connector", "KVConnectorContext": "kv_connector", "KVConnectorFactory": "kv_connector",
    "KVConnectorMetadata": "kv_connector", "KVConnectorRequest": "kv_connector", "KVConnectorRole": "kv_connector",
    "AddedRequest": "logits", "BatchUpdate": "logits", "LogitsProcessor": "logits", "MoveDirectionality": "logits",
    "MovedRequest": "logits",
    "BaseModelLoader": "model_loader", "LoadConfig": "model_loader", "ModelLoaderRegistry": "model_loader",
    "ModelRegistry": "models",
    "DeltaFunctionCall": "parsers", "DeltaMessage": "parsers", "DeltaToolCall": "parsers",
    "ExtractedToolCalls": "parsers", "FunctionCall": "parsers", "ReasoningParser": "parsers",
    "ReasoningParserManager": "parsers", "ToolCall": "parsers", "ToolParser": "parsers", "ToolParserManager": "parsers",
    "new_tool_call_id": "parsers",
    "Platform": "platform", "PlatformEnum": "platform",
    "LinearMethod": "quantization", "QuantizationConfig": "quantization", "QuantizationRegistry": "quantization",
    "BUILT_IN": "registry", "Registry": "registry", "RegistrationError": "registry", "reads": "registry",
    "ENGINE_CORE": "roles", "FRONTEND": "roles", "ROLES": "roles", "WORKER": "roles",
    "SchedulerInterface": "scheduler",
    "StatLoggerBase": "stat_logger",
    "GrammarMatcher": "structured_output", "StructuredOutputBackend": "structured_output",
    "StructuredOutputBackendRegistry": "structured_output",
    "all_registries": "tables",
    "TokenizerRegistry": "tokenizer",
    "WorkerBase": "worker",
    # An nn.Module: the one name whose module imports torch.
    "CustomOp": "torch_bases",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "BUILT_IN", "ENGINE_CORE", "FRONTEND", "ROLES", "WORKER", "AddedRequest", "AdditionalConfigRegistry",
    "AttentionBackend", "AttentionBackendRegistry", "BaseModelLoader", "BatchUpdate", "ClassPathImportError",
    "CustomOp", "CustomOpRegistry", "DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "EndpointPlugin",
    "Executor", "ExtractedToolCalls", "FunctionCall", "GrammarMatcher", "IOProcessor", "KVConnectorBase",
    "KVConnectorContext", "KVConnectorFactory", "KVConnectorMetadata", "KVConnectorRequest", "KVConnectorRole",
    "LinearMethod", "LoadConfig", "LogitsProcessor", "ModelLoaderRegistry", "ModelRegistry", "MoveDirectionality",
    "MovedRequest", "OpProviderRegistry", "Platform", "PlatformEnum", "QuantizationConfig", "QuantizationRegistry",
    "ReasoningParser", "ReasoningParserManager", "RegistrationError", "Registry", "SchedulerInterface",
    "StatLoggerBase",
    "StructuredOutputBackend", "StructuredOutputBackendRegistry", "TokenizerRegistry", "ToolCall", "ToolParser",
    "ToolParserManager", "WorkerBase", "all_registries", "import_by_path", "new_tool_call_id", "reads",
]
