"""Every public name of asyncengine.plugins_api, the face plugins import, is the object at the name's one
home (its defining module), and none is lost: the table below was taken from plugins_api before issue 31
removed the modules that re-exported names (moved modules' new paths written in), so a name that goes
missing, or that plugins_api starts taking from a copy, fails here."""

from __future__ import annotations

import importlib

import pytest

import asyncengine.plugins_api as plugins_api

# Public name -> "module:attribute" of its home ("module" alone: the name is a module).
HOMES = {
    "register_attention_backend": "asyncengine.attention.registry:register_attention_backend",
    "EngineConfig": "asyncengine.config.engine:EngineConfig",
    "VllmConfig": "asyncengine.config.engine:EngineConfig",
    "KVTransferConfig": "asyncengine.config.kv_transfer:KVTransferConfig",
    "MultiprocExecutor": "asyncengine.engine_core.executor:MultiprocExecutor",
    "UniExecutor": "asyncengine.engine_core.executor:UniExecutor",
    "Scheduler": "asyncengine.engine_core.scheduler:Scheduler",
    "SchedulerInterface": "asyncengine.interfaces.scheduler:SchedulerInterface",
    "ConfigError": "asyncengine.errors:ConfigError",
    "RequestError": "asyncengine.errors:RequestError",
    "AdditionalConfigRegistry": "asyncengine.interfaces.additional_config:AdditionalConfigRegistry",
    "AttentionBackend": "asyncengine.interfaces.attention:AttentionBackend",
    "AttentionBackendRegistry": "asyncengine.interfaces.attention:AttentionBackendRegistry",
    "EndpointPlugin": "asyncengine.interfaces.endpoint:EndpointPlugin",
    "Executor": "asyncengine.interfaces.executor:Executor",
    "IOProcessor": "asyncengine.interfaces.io_processor:IOProcessor",
    "IOProcessorInput": "asyncengine.interfaces.io_processor:IOProcessorInput",
    "IOProcessorOutput": "asyncengine.interfaces.io_processor:IOProcessorOutput",
    "IOProcessorResponse": "asyncengine.interfaces.io_processor:IOProcessorResponse",
    "PromptType": "asyncengine.interfaces.io_processor:PromptType",
    "TextPrompt": "asyncengine.interfaces.io_processor:TextPrompt",
    "TokensPrompt": "asyncengine.interfaces.io_processor:TokensPrompt",
    "KVConnectorBase": "asyncengine.interfaces.kv_connector:KVConnectorBase",
    "KVConnectorContext": "asyncengine.interfaces.kv_connector:KVConnectorContext",
    "KVConnectorFactory": "asyncengine.interfaces.kv_connector:KVConnectorFactory",
    "KVConnectorMetadata": "asyncengine.interfaces.kv_connector:KVConnectorMetadata",
    "KVConnectorRequest": "asyncengine.interfaces.kv_connector:KVConnectorRequest",
    "KVConnectorRole": "asyncengine.interfaces.kv_connector:KVConnectorRole",
    "AddedRequest": "asyncengine.interfaces.logits:AddedRequest",
    "BatchUpdate": "asyncengine.interfaces.logits:BatchUpdate",
    "LogitsProcessor": "asyncengine.interfaces.logits:LogitsProcessor",
    "MoveDirectionality": "asyncengine.interfaces.logits:MoveDirectionality",
    "MovedRequest": "asyncengine.interfaces.logits:MovedRequest",
    "LoRARequest": "asyncengine.interfaces.lora_resolver:LoRARequest",
    "LoRAResolver": "asyncengine.interfaces.lora_resolver:LoRAResolver",
    "LoRAResolverRegistry": "asyncengine.interfaces.lora_resolver:LoRAResolverRegistry",
    "BaseModelLoader": "asyncengine.interfaces.model_loader:BaseModelLoader",
    "LoadConfig": "asyncengine.interfaces.model_loader:LoadConfig",
    "ModelLoaderRegistry": "asyncengine.interfaces.model_loader:ModelLoaderRegistry",
    "ModelRegistry": "asyncengine.interfaces.models:ModelRegistry",
    "DeltaFunctionCall": "asyncengine.interfaces.parsers:DeltaFunctionCall",
    "DeltaMessage": "asyncengine.interfaces.parsers:DeltaMessage",
    "DeltaToolCall": "asyncengine.interfaces.parsers:DeltaToolCall",
    "ExtractedToolCalls": "asyncengine.interfaces.parsers:ExtractedToolCalls",
    "FunctionCall": "asyncengine.interfaces.parsers:FunctionCall",
    "ReasoningParser": "asyncengine.interfaces.parsers:ReasoningParser",
    "ReasoningParserManager": "asyncengine.interfaces.parsers:ReasoningParserManager",
    "ToolCall": "asyncengine.interfaces.parsers:ToolCall",
    "ToolParser": "asyncengine.interfaces.parsers:ToolParser",
    "ToolParserManager": "asyncengine.interfaces.parsers:ToolParserManager",
    "new_tool_call_id": "asyncengine.interfaces.parsers:new_tool_call_id",
    "AttentionSelectorConfig": "asyncengine.interfaces.platform:AttentionSelectorConfig",
    "DeviceCapability": "asyncengine.interfaces.platform:DeviceCapability",
    "Platform": "asyncengine.interfaces.platform:Platform",
    "PlatformEnum": "asyncengine.interfaces.platform:PlatformEnum",
    "Pooler": "asyncengine.interfaces.pooler:Pooler",
    "PoolerRegistry": "asyncengine.interfaces.pooler:PoolerRegistry",
    "register_pooler": "asyncengine.interfaces.pooler:register_pooler",
    "LinearBase": "asyncengine.interfaces.quantization:LinearBase",
    "LinearMethod": "asyncengine.interfaces.quantization:LinearMethod",
    "LinearMethodBase": "asyncengine.interfaces.quantization:LinearMethodBase",
    "QuantizationConfig": "asyncengine.interfaces.quantization:QuantizationConfig",
    "QuantizationRegistry": "asyncengine.interfaces.quantization:QuantizationRegistry",
    "QuantizeMethodBase": "asyncengine.interfaces.quantization:QuantizeMethodBase",
    "RegistrationError": "asyncengine.interfaces.registry:RegistrationError",
    "Registry": "asyncengine.interfaces.registry:Registry",
    "StatLoggerBase": "asyncengine.interfaces.stat_logger:StatLoggerBase",
    "GrammarMatcher": "asyncengine.interfaces.structured_output:GrammarMatcher",
    "StructuredOutputBackend": "asyncengine.interfaces.structured_output:StructuredOutputBackend",
    "StructuredOutputBackendRegistry": "asyncengine.interfaces.structured_output:StructuredOutputBackendRegistry",
    "TokenizerRegistry": "asyncengine.interfaces.tokenizer:TokenizerRegistry",
    "CustomOp": "asyncengine.interfaces.torch_bases:CustomOp",
    "LocalDiskConnector": "asyncengine.kv_transfer.local_disk:LocalDiskConnector",
    "SafetensorsLoader": "asyncengine.loader.registry:SafetensorsLoader",
    "register_model_loader": "asyncengine.loader.registry:register_model_loader",
    "SiluAndMul": "asyncengine.models.layers.activation:SiluAndMul",
    "FusedMoE": "asyncengine.models.layers.fused_moe:FusedMoE",
    "RMSNorm": "asyncengine.models.layers.norm:RMSNorm",
    "register_op_impl": "asyncengine.models.layers.op_registry:register_op_impl",
    "UnquantizedLinearMethod": "asyncengine.models.layers.quantization:UnquantizedLinearMethod",
    "register_quantization_config": "asyncengine.models.layers.quantization:register_quantization_config",
    "RotaryEmbedding": "asyncengine.models.layers.rotary:RotaryEmbedding",
    "LlamaForCausalLM": "asyncengine.models.llama:LlamaForCausalLM",
    "MoeConfig": "asyncengine.ops.fused_moe:MoeConfig",
    "fused_moe_reference": "asyncengine.ops.fused_moe:fused_moe_reference",
    "select_experts": "asyncengine.ops.fused_moe:select_experts",
    "CompletionOutput": "asyncengine.outputs:CompletionOutput",
    "RequestOutput": "asyncengine.outputs:RequestOutput",
    "CpuPlatform": "asyncengine.platforms.cpu:CpuPlatform",
    "CudaPlatform": "asyncengine.platforms.cuda:CudaPlatform",
    "CudaPlatformBase": "asyncengine.platforms.cuda:CudaPlatformBase",
    "NonNvmlCudaPlatform": "asyncengine.platforms.cuda:NonNvmlCudaPlatform",
    "NvmlCudaPlatform": "asyncengine.platforms.cuda:NvmlCudaPlatform",
    "current_platform": "asyncengine.plugin_runtime.platform_resolution:current_platform",
    "requested_device": "asyncengine.plugin_runtime.platform_resolution:requested_device",
    "current_process_role": "asyncengine.plugin_runtime.records:current_process_role",
    "load_endpoint_plugins": "asyncengine.compat.plugins:load_endpoint_plugins",
    "load_general_plugins": "asyncengine.compat.plugins:load_general_plugins",
    "load_plugins_by_group": "asyncengine.compat.plugins:load_plugins_by_group",
    "load_stat_logger_plugin_factories": "asyncengine.compat.plugins:load_stat_logger_plugin_factories",
    "PoolingOutput": "asyncengine.pooling.outputs:PoolingOutput",
    "PoolingRequestOutput": "asyncengine.pooling.outputs:PoolingRequestOutput",
    "PoolingParams": "asyncengine.pooling.params:PoolingParams",
    "IOProcessRequest": "asyncengine.server.protocol:IOProcessRequest",
    "register_structured_output_backend": "asyncengine.structured_output.registry:register_structured_output_backend",
    "GrammarSpec": "asyncengine.structured_output_spec:GrammarSpec",
    "CPUWorker": "asyncengine.worker.cpu_worker:CPUWorker",
    "KVCacheConfig": "asyncengine.worker.cpu_worker:KVCacheConfig",
    "Worker": "asyncengine.worker.worker:Worker",
    "MULTIMODAL_REGISTRY": "asyncengine.interfaces.multimodal_registry:MULTIMODAL_REGISTRY",
    "MultiModalRegistry": "asyncengine.interfaces.multimodal_registry:MultiModalRegistry",
    "BaseMultiModalProcessor": "asyncengine.interfaces.multimodal_registry:BaseMultiModalProcessor",
    "BaseProcessingInfo": "asyncengine.interfaces.multimodal_registry:BaseProcessingInfo",
    "BaseDummyInputsBuilder": "asyncengine.interfaces.multimodal_registry:BaseDummyInputsBuilder",
    "ProcessingContext": "asyncengine.interfaces.multimodal_registry:ProcessingContext",
    "ProcessedItem": "asyncengine.interfaces.multimodal_registry:ProcessedItem",
    "envs": "asyncengine.compat.envs",  # a module
}


def test_plugins_api_offers_every_name_it_offered() -> None:
    assert sorted(plugins_api.__all__) == sorted(HOMES)


@pytest.mark.parametrize("name", sorted(HOMES))
def test_each_public_name_is_the_object_at_its_home(name: str) -> None:
    module, _, attribute = HOMES[name].partition(":")
    home = importlib.import_module(module)
    assert getattr(plugins_api, name) is (getattr(home, attribute) if attribute else home)
