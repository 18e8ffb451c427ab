"""The floor: every class a plugin subclasses or implements, the registry tables, `import_by_path` and
the role names.

Everything above it (the plugin runtime, the roles' code, the server and the CLI) imports these from here;
this package imports only asyncengine.config, asyncengine.errors and the floor's request types, and no
torch: the one torch-based module, interfaces.torch_bases (CustomOp), is imported when asked for
(`asyncengine.interfaces.CustomOp` does). Plugins keep importing from asyncengine.plugins_api, the public
face, which re-exports what is here.

One module per concern, each with its table where it has one:

- platform: Platform, PlatformEnum
- attention: AttentionBackend, AttentionBackendRegistry
- io_processor, stat_logger, endpoint: IOProcessor, StatLoggerBase, EndpointPlugin (read in the frontend)
- logits: LogitsProcessor, BatchUpdate (AddedRequest, MovedRequest, MoveDirectionality)
- kv_connector: KVConnectorBase and its parts, KVConnectorFactory
- executor, worker: Executor, WorkerBase
- quantization: QuantizationConfig, LinearMethod, QuantizationRegistry
- model_loader, models: BaseModelLoader, LoadConfig, ModelLoaderRegistry; ModelRegistry
- structured_output: StructuredOutputBackend, GrammarMatcher, StructuredOutputBackendRegistry
- custom_op_registry, torch_bases: the custom-op tables; CustomOp
- registry, tables, imports, roles: the Registry type, every table and who reads it, import_by_path, the role names
"""

from __future__ import annotations

from typing import Any

from asyncengine.interfaces.attention import AttentionBackend, AttentionBackendRegistry
from asyncengine.interfaces.custom_op_registry import CustomOpRegistry, OpProviderRegistry
from asyncengine.interfaces.endpoint import EndpointPlugin
from asyncengine.interfaces.executor import Executor
from asyncengine.interfaces.imports import ClassPathImportError, import_by_path
from asyncengine.interfaces.io_processor import IOProcessor
from asyncengine.interfaces.kv_connector import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorFactory,
    KVConnectorMetadata,
    KVConnectorRequest,
    KVConnectorRole,
)
from asyncengine.interfaces.logits import AddedRequest, BatchUpdate, LogitsProcessor, MoveDirectionality, MovedRequest
from asyncengine.interfaces.model_loader import BaseModelLoader, LoadConfig, ModelLoaderRegistry
from asyncengine.interfaces.models import ModelRegistry
from asyncengine.interfaces.platform import Platform, PlatformEnum
from asyncengine.interfaces.quantization import LinearMethod, QuantizationConfig, QuantizationRegistry
from asyncengine.interfaces.registry import BUILT_IN, Registry, RegistrationError, reads
from asyncengine.interfaces.roles import ENGINE_CORE, FRONTEND, ROLES, WORKER
from asyncengine.interfaces.stat_logger import StatLoggerBase
from asyncengine.interfaces.structured_output import (
    GrammarMatcher,
    StructuredOutputBackend,
    StructuredOutputBackendRegistry,
)
from asyncengine.interfaces.tables import all_registries
from asyncengine.interfaces.worker import WorkerBase


def __getattr__(name: str) -> Any:
    # CustomOp is an nn.Module: imported when asked for, so that importing the floor does not import torch.
    if name == "CustomOp":
        from asyncengine.interfaces.torch_bases import CustomOp

        return CustomOp
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUILT_IN", "ENGINE_CORE", "FRONTEND", "ROLES", "WORKER",
    "AddedRequest", "AttentionBackend", "AttentionBackendRegistry", "BaseModelLoader", "BatchUpdate",
    "ClassPathImportError", "CustomOp", "CustomOpRegistry", "EndpointPlugin", "Executor", "GrammarMatcher",
    "IOProcessor", "KVConnectorBase", "KVConnectorContext", "KVConnectorFactory", "KVConnectorMetadata",
    "KVConnectorRequest", "KVConnectorRole", "LinearMethod", "LoadConfig", "LogitsProcessor", "ModelLoaderRegistry",
    "ModelRegistry", "MoveDirectionality", "MovedRequest", "OpProviderRegistry", "Platform", "PlatformEnum",
    "QuantizationConfig", "QuantizationRegistry", "Registry", "RegistrationError", "StatLoggerBase",
    "StructuredOutputBackend", "StructuredOutputBackendRegistry", "WorkerBase", "all_registries", "import_by_path",
    "reads",
]
