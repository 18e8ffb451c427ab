"""Everything a plugin may import from asyncengine: the extension interfaces and register functions.

The interfaces and registry tables live in the floor, asyncengine.interfaces (imported here from there:
the same objects); the built-in implementations to subclass and the register functions come from the
modules that own them. This module stays the documented face.

Plugins import only this module (first-party ones under plugins/ included). Names follow vLLM's, so a
vLLM plugin ports by renaming imports. Each entry says which process reads it: a registry filled in
one process is invisible to the others, so register from a general plugin (entry-point group
`asyncengine.general_plugins`), which every process loads; the start-up manifest check names any key
the frontend has and a child lacks.
"""

from __future__ import annotations

from asyncengine.interfaces.attention import AttentionBackend  # read in: worker (one instance per attention layer)
from asyncengine.interfaces.attention import (  # read in: worker (the platform or `attention_backend` names one)
    AttentionBackendRegistry,
)
from asyncengine.attention.registry import register_attention_backend
from asyncengine.interfaces.executor import Executor  # read in: engine core (distributed_executor_backend=mod:Class)
from asyncengine.engine_core.executor import MultiprocExecutor, UniExecutor  # the built-ins, to subclass
from asyncengine.engine_core.scheduler import Scheduler  # read in: engine core (`--scheduler-cls`, to subclass)
from asyncengine.interfaces.scheduler import SchedulerInterface  # read in: engine core (`--scheduler-cls` implements it)
from asyncengine.errors import RequestError  # raise it to refuse a request (LogitsProcessor.validate_params)
from asyncengine.errors import ConfigError  # raise it to refuse an option (check_and_update_config, validators)
from asyncengine.interfaces.endpoint import EndpointPlugin  # read in: frontend (opt-in)
from asyncengine.interfaces.io_processor import (  # read in: frontend (`--io-processor-plugin NAME`)
    IOProcessor,
    IOProcessorInput,
    IOProcessorOutput,
    IOProcessorResponse,
    PromptType,
    TextPrompt,
    TokensPrompt,
)
from asyncengine.outputs import CompletionOutput, RequestOutput  # what IOProcessor.post_process receives
from asyncengine.server.protocol import IOProcessRequest  # read in: frontend (what IOProcessor.pre_process receives)
from asyncengine.interfaces.stat_logger import StatLoggerBase  # read in: frontend
from asyncengine.interfaces.tokenizer import TokenizerRegistry  # read in: frontend (chosen by --tokenizer-mode)
from asyncengine.interfaces.kv_connector import (  # the KV connector interface: scheduler side in the engine core,
    KVConnectorBase,  # worker side in each worker rank (docs/kv_connectors.md)
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRequest,
    KVConnectorRole,
)
from asyncengine.config.kv_transfer import KVTransferConfig  # kv_transfer_config, checked (every process)
from asyncengine.interfaces.kv_connector import KVConnectorFactory  # read in: engine core, worker
from asyncengine.kv_transfer.local_disk import LocalDiskConnector  # the built-in connector, to subclass or wrap
from asyncengine.interfaces.model_loader import (  # read in: worker (build), frontend (checks --load-format)
    BaseModelLoader,
    LoadConfig,
    ModelLoaderRegistry,
)
from asyncengine.loader.registry import SafetensorsLoader, register_model_loader
from asyncengine.models.layers.op_registry import register_op_impl  # read in: worker (op providers, per call)
from asyncengine.interfaces.quantization import (  # read in: worker (build), frontend (checks the name)
    LinearBase,
    LinearMethod,
    LinearMethodBase,
    QuantizationConfig,
    QuantizationRegistry,
    QuantizeMethodBase,
)
from asyncengine.models.layers.quantization import UnquantizedLinearMethod, register_quantization_config
from asyncengine.interfaces.models import ModelRegistry  # read in: frontend (validate), worker (build)
from asyncengine.interfaces.multimodal import (  # read in: worker (a model class with supports_multimodal)
    MultiModalEmbeddings,
    SupportsMultiModal,
    merge_multimodal_embeddings,
)
from asyncengine.interfaces.pooler import (  # read in: worker (a pooling model's pooler, by --pooler-config)
    Pooler,
    PoolerRegistry,
    register_pooler,
)
from asyncengine.interfaces.spec_decode import (  # read in: frontend (checks `method`), worker (builds the proposer)
    DraftTokens,
    ProposalBatch,
    Proposer,
    ProposerContext,
    ProposerRegistry,
    register_proposer,
)
from asyncengine.config.speculative import SpeculativeConfig  # what a Proposer is built with
from asyncengine.pooling.params import PoolingParams  # what a pooling request carries (LLM.embed, encode, ...)
from asyncengine.pooling.outputs import PoolingOutput, PoolingRequestOutput  # what post_process gets on /pooling
from asyncengine.interfaces.platform import Platform, PlatformEnum  # read in: every process
from asyncengine.interfaces.platform import AttentionSelectorConfig, DeviceCapability  # what platform hooks take
from asyncengine.platforms.cpu import CpuPlatform  # the built-in platforms, to subclass (vLLM's plugins do)
from asyncengine.platforms.cuda import CudaPlatform, CudaPlatformBase, NonNvmlCudaPlatform, NvmlCudaPlatform
from asyncengine.config.engine import EngineConfig  # what check_and_update_config receives
from asyncengine.config.engine import EngineConfig as VllmConfig  # vLLM's name: sub-config views read through
from asyncengine.compat import envs  # vLLM's environment flags, the few that mean something here
from asyncengine.compat.plugins import (  # vLLM's helpers for plugin tests
    load_endpoint_plugins,
    load_general_plugins,
    load_plugins_by_group,
    load_stat_logger_plugin_factories,
)
from asyncengine.interfaces.additional_config import (  # read in: frontend (checks every key is claimed)
    AdditionalConfigRegistry,
)
from asyncengine.plugin_runtime.platform_resolution import current_platform
from asyncengine.plugin_runtime.platform_resolution import requested_device
from asyncengine.plugin_runtime.records import current_process_role  # every process: where this code runs
from asyncengine.interfaces.registry import Registry, RegistrationError  # the registry type itself
from asyncengine.interfaces.multimodal_registry import (  # read in: frontend (process images), worker (profile)
    MULTIMODAL_REGISTRY,
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    MultiModalRegistry,
    ProcessedItem,
    ProcessingContext,
)
from asyncengine.interfaces.parsers import (  # read in: frontend (the chat completions route)
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ReasoningParser,
    ReasoningParserManager,
    ToolCall,
    ToolParser,
    ToolParserManager,
    new_tool_call_id,
)
from asyncengine.interfaces.structured_output import (  # read in: engine core (compiles, masks), frontend (validate)
    GrammarMatcher,
    StructuredOutputBackend,
)
from asyncengine.interfaces.structured_output import (  # read in: engine core, frontend
    StructuredOutputBackendRegistry,
)
from asyncengine.structured_output.registry import register_structured_output_backend
from asyncengine.structured_output_spec import GrammarSpec  # what a backend compiles
from asyncengine.interfaces.lora_resolver import (  # read in: frontend (an adapter name nobody knows yet)
    LoRAResolver,
    LoRAResolverRegistry,
)
from asyncengine.interfaces.lora_resolver import LoRARequest
from asyncengine.interfaces.logits import LogitsProcessor  # read in: worker (build), frontend (validate)
from asyncengine.interfaces.logits import (  # read in: worker (what update_state receives)
    AddedRequest,
    BatchUpdate,
    MoveDirectionality,
    MovedRequest,
)


_IN_TREE_OPS = {"RMSNorm": "asyncengine.models.layers.norm", "SiluAndMul": "asyncengine.models.layers.activation",
                "RotaryEmbedding": "asyncengine.models.layers.rotary", "FusedMoE": "asyncengine.models.layers.fused_moe"}


_LLAVA_NAMES = ("LlavaForConditionalGeneration", "LlavaMultiModalProcessor", "LlavaProcessingInfo",
                "LlavaDummyInputsBuilder")


def __getattr__(name: str):
    # CustomOp (read in: worker; `CustomOp.register_oot` replaces an in-tree op by name) is an nn.Module:
    # imported when asked for, so that importing this module does not import torch.
    if name == "CustomOp":
        from asyncengine.interfaces.torch_bases import CustomOp

        return CustomOp
    # The in-tree custom ops (read in: worker), to subclass and replace with `@RotaryEmbedding.register_oot`.
    if name in _IN_TREE_OPS:
        import importlib

        return getattr(importlib.import_module(_IN_TREE_OPS[name]), name)
    # The MoE op's arguments and its torch reference (op "fused_moe", read in: worker): a provider receives a
    # MoeConfig, and may call the shared routing (select_experts) or the reference. Imports torch too.
    if name in ("MoeConfig", "select_experts", "fused_moe_reference"):
        from asyncengine.ops import fused_moe

        return getattr(fused_moe, name)
    # LlamaForCausalLM (read in: worker, which builds the model; frontend, which checks the architecture):
    # subclass it for an out-of-tree architecture (ModelRegistry.register_model). Imports torch too.
    if name == "LlamaForCausalLM":
        from asyncengine.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    # LLaVA and its input processing's three classes (read in: worker, which builds the model; frontend, which
    # processes its images through MULTIMODAL_REGISTRY): subclass them for an out-of-tree LLaVA. Imports torch too.
    if name in _LLAVA_NAMES:
        from asyncengine.models import llava

        return getattr(llava, name)
    # BertModel (read in: worker): the built-in encoder, to subclass for an out-of-tree embedding architecture
    # (ModelRegistry.register_model; it says `is_pooling_model = True`). Imports torch too.
    if name == "BertModel":
        from asyncengine.models.bert import BertModel

        return BertModel
    # Worker (read in: worker; `--worker-cls pkg.mod:Class` subclasses it). Imports torch too.
    if name == "Worker":
        from asyncengine.worker.worker import Worker

        return Worker
    # CPUWorker (read in: worker): vLLM's CPU worker's name and shape (constructor, vLLM's method names), for a
    # platform's worker_cls to subclass as vLLM's platform plugins do (worker/cpu_worker.py). Imports torch too.
    if name in ("CPUWorker", "KVCacheConfig"):
        from asyncengine.worker import cpu_worker

        return getattr(cpu_worker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# `--worker-extension-cls` (read in: worker) needs no base class: any class built as Class(worker), whose
# public methods collective_rpc reaches after the worker's own (docs/hooks.md).

__all__ = [
    "MULTIMODAL_REGISTRY",
    "MultiModalRegistry",
    "BaseMultiModalProcessor",
    "BaseProcessingInfo",
    "BaseDummyInputsBuilder",
    "ProcessingContext",
    "ProcessedItem",
    "AttentionSelectorConfig",
    "CPUWorker",
    "CudaPlatformBase",
    "DeviceCapability",
    "IOProcessorInput",
    "IOProcessorOutput",
    "IOProcessorResponse",
    "KVCacheConfig",
    "NonNvmlCudaPlatform",
    "NvmlCudaPlatform",
    "PoolingOutput",
    "PromptType",
    "TextPrompt",
    "TokensPrompt",
    "Pooler",
    "PoolerRegistry",
    "PoolingParams",
    "PoolingRequestOutput",
    "register_pooler",
    "DraftTokens",
    "ProposalBatch",
    "Proposer",
    "ProposerContext",
    "ProposerRegistry",
    "SpeculativeConfig",
    "register_proposer",
    "AddedRequest",
    "AdditionalConfigRegistry",
    "CustomOp",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "FusedMoE",
    "MoeConfig",
    "select_experts",
    "fused_moe_reference",
    "register_op_impl",
    "AttentionBackend",
    "AttentionBackendRegistry",
    "register_attention_backend",
    "BatchUpdate",
    "EndpointPlugin",
    "Executor",
    "MultiprocExecutor",
    "UniExecutor",
    "IOProcessor",
    "IOProcessRequest",
    "RequestOutput",
    "CompletionOutput",
    "KVConnectorBase",
    "KVConnectorContext",
    "KVConnectorFactory",
    "KVConnectorMetadata",
    "KVConnectorRequest",
    "KVConnectorRole",
    "KVTransferConfig",
    "LocalDiskConnector",
    "LlamaForCausalLM",
    "LlavaForConditionalGeneration",
    "LlavaMultiModalProcessor",
    "LlavaProcessingInfo",
    "LlavaDummyInputsBuilder",
    "LogitsProcessor",
    "MoveDirectionality",
    "MovedRequest",
    "ModelRegistry",
    "MultiModalEmbeddings",
    "SupportsMultiModal",
    "merge_multimodal_embeddings",
    "Platform",
    "PlatformEnum",
    "CpuPlatform",
    "CudaPlatform",
    "EngineConfig",
    "VllmConfig",
    "envs",
    "load_endpoint_plugins",
    "load_plugins_by_group",
    "load_general_plugins",
    "load_stat_logger_plugin_factories",
    "Registry",
    "RegistrationError",
    "RequestError",
    "Scheduler",
    "SchedulerInterface",
    "StatLoggerBase",
    "TokenizerRegistry",
    "Worker",
    "current_platform",
    "requested_device",
    "ConfigError",
    "current_process_role",
    "BaseModelLoader",
    "LoadConfig",
    "ModelLoaderRegistry",
    "register_model_loader",
    "SafetensorsLoader",
    "LinearBase",
    "LinearMethod",
    "LinearMethodBase",
    "QuantizationConfig",
    "QuantizationRegistry",
    "QuantizeMethodBase",
    "register_quantization_config",
    "UnquantizedLinearMethod",
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "FunctionCall",
    "new_tool_call_id",
    "ReasoningParser",
    "ReasoningParserManager",
    "ToolCall",
    "ToolParser",
    "LoRARequest",
    "LoRAResolver",
    "LoRAResolverRegistry",
    "ToolParserManager",
    "GrammarMatcher",
    "GrammarSpec",
    "StructuredOutputBackend",
    "StructuredOutputBackendRegistry",
    "register_structured_output_backend",
]
