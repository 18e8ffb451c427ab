"""The renames `asyncengine plugins port` applies, and what it knows it cannot map.

docs/porting.md prints these tables (tests/porting checks the page against them), so the page and the
tool cannot drift apart. Each row is vLLM's name and ours; the `section` of an unmapped row is the
docs/porting.md section that says what to do instead.
"""

from __future__ import annotations

API = "asyncengine.plugins_api"

ENTRY_POINT_GROUPS = {
    "vllm.general_plugins": "asyncengine.general_plugins",
    "vllm.platform_plugins": "asyncengine.platform_plugins",
    "vllm.io_processor_plugins": "asyncengine.io_processor_plugins",
    "vllm.stat_logger_plugins": "asyncengine.stat_logger_plugins",
    "vllm.logits_processors": "asyncengine.logits_processors",
    "vllm.endpoint_plugins": "asyncengine.endpoint_plugins",
}

ENVIRONMENT_VARIABLES = {"VLLM_PLUGINS": "ASYNCENGINE_PLUGINS"}

# The vLLM environment flags asyncengine.plugins_api.envs answers (asyncengine/compat/envs.py holds the same list).
ENVS_ANSWERED = ("VLLM_USE_V1", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_PLUGINS", "VLLM_LOGGING_LEVEL",
                 "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_PREFIX", "VLLM_HOST_IP", "VLLM_PORT", "VLLM_CPU_KVCACHE_SPACE",
                 "VLLM_CPU_OMP_THREADS_BIND")

# (vLLM module, name) -> (our module, our name). `from MODULE import NAME` becomes `from OURS import NEW`.
_API_NAMES = {
    "vllm": ["ModelRegistry", "envs", "PoolingParams", "PoolingRequestOutput", "TokensPrompt", "TextPrompt"],
    "vllm.config": ["VllmConfig", "LoadConfig", "KVTransferConfig"],
    "vllm.config.load": ["LoadConfig"],
    "vllm.pooling_params": ["PoolingParams"],
    "vllm.inputs": ["TokensPrompt", "TextPrompt", "PromptType"],
    "vllm.inputs.data": ["TokensPrompt", "TextPrompt", "PromptType"],
    "vllm.envs": [],
    "vllm.model_executor.models": ["ModelRegistry"],
    "vllm.model_executor.models.llama": ["LlamaForCausalLM"],
    "vllm.model_executor.models.llava": ["LlavaForConditionalGeneration", "LlavaMultiModalProcessor",
                                         "LlavaProcessingInfo", "LlavaDummyInputsBuilder"],
    "vllm.model_executor.custom_op": ["CustomOp"],
    "vllm.model_executor.layers.rotary_embedding": ["RotaryEmbedding"],
    "vllm.model_executor.layers.layernorm": ["RMSNorm"],
    "vllm.model_executor.layers.activation": ["SiluAndMul"],
    "vllm.model_executor.layers.fused_moe": ["FusedMoE"],
    "vllm.model_executor.layers.fused_moe.layer": ["FusedMoE"],
    "vllm.attention.backends.abstract": ["AttentionBackend"],
    "vllm.v1.attention.backend": ["AttentionBackend"],
    "vllm.v1.attention.backends.abstract": ["AttentionBackend"],
    "vllm.attention.selector": ["AttentionSelectorConfig"],
    "vllm.v1.attention.selector": ["AttentionSelectorConfig"],
    "vllm.model_executor.layers.quantization": ["register_quantization_config", "QuantizationConfig"],
    "vllm.model_executor.layers.quantization.base_config": ["QuantizationConfig", "QuantizeMethodBase"],
    "vllm.model_executor.layers.linear": ["LinearBase", "LinearMethodBase", "UnquantizedLinearMethod"],
    "vllm.model_executor.model_loader": ["register_model_loader", "BaseModelLoader"],
    "vllm.model_executor.model_loader.base_loader": ["BaseModelLoader"],
    "vllm.distributed.kv_transfer.kv_connector.factory": ["KVConnectorFactory"],
    "vllm.entrypoints.openai.tool_parsers": ["ToolParserManager", "ToolParser"],
    "vllm.entrypoints.openai.tool_parsers.abstract_tool_parser": ["ToolParserManager", "ToolParser"],
    "vllm.reasoning": ["ReasoningParserManager", "ReasoningParser"],
    "vllm.transformers_utils.tokenizer_base": ["TokenizerRegistry"],
    "vllm.v1.core.sched.scheduler": ["Scheduler"],
    "vllm.core.scheduler": ["Scheduler"],
    "vllm.v1.core.sched.interface": ["SchedulerInterface"],
    "vllm.v1.worker.gpu_worker": ["Worker"],
    "vllm.v1.worker.cpu_worker": ["CPUWorker"],
    "vllm.worker.worker": ["Worker"],
    "vllm.v1.sample.logits_processor": ["LogitsProcessor", "BatchUpdate", "MoveDirectionality"],
    "vllm.v1.executor.abstract": ["Executor"],
    "vllm.v1.metrics.loggers": ["StatLoggerBase", "load_stat_logger_plugin_factories"],
    "vllm.plugins": ["load_general_plugins", "load_endpoint_plugins", "load_plugins_by_group"],
    "vllm.plugins.io_processors": ["IOProcessor"],
    "vllm.plugins.io_processors.interface": ["IOProcessor", "IOProcessorInput", "IOProcessorOutput"],
    "vllm.entrypoints.pooling.pooling.protocol": ["IOProcessorResponse"],
    "vllm.entrypoints.openai.protocol": ["IOProcessorResponse"],
    "vllm.plugins.endpoint_plugins": ["EndpointPlugin"],
    "vllm.entrypoints.serve.endpoint_plugin": ["EndpointPlugin"],
    "vllm.plugins.endpoint_plugins.interface": ["EndpointPlugin"],
    "vllm.platforms": ["current_platform", "Platform", "PlatformEnum"],
    "vllm.platforms.interface": ["Platform", "PlatformEnum", "DeviceCapability"],
    "vllm.platforms.cpu": ["CpuPlatform"],
    "vllm.platforms.cuda": ["CudaPlatform", "CudaPlatformBase", "NvmlCudaPlatform", "NonNvmlCudaPlatform"],
    "vllm.outputs": ["RequestOutput", "CompletionOutput", "PoolingRequestOutput", "PoolingOutput"],
    # The multimodal processor registry (R14) and its three base classes (docs/multimodal.md)
    "vllm.multimodal": ["MULTIMODAL_REGISTRY", "MultiModalRegistry"],
    "vllm.multimodal.registry": ["MULTIMODAL_REGISTRY", "MultiModalRegistry"],
    "vllm.multimodal.processing": ["BaseMultiModalProcessor", "BaseProcessingInfo", "BaseDummyInputsBuilder"],
    "vllm.multimodal.profiling": ["BaseDummyInputsBuilder"],
    "vllm.model_executor.models.interfaces": ["SupportsMultiModal", "MultiModalEmbeddings"],
}
IMPORTS: dict[tuple[str, str], tuple[str, str]] = {
    (module, name): (API, name) for module, names in _API_NAMES.items() for name in names
}
IMPORTS.update({
    ("vllm", "LLM"): ("asyncengine", "LLM"),
    ("vllm", "SamplingParams"): ("asyncengine", "SamplingParams"),
    ("vllm.sampling_params", "SamplingParams"): ("asyncengine", "SamplingParams"),
    ("vllm.v1.executor.uniproc_executor", "UniProcExecutor"): (API, "UniExecutor"),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor"): (API, "MultiprocExecutor"),
})
# vLLM's engine-level names that plugin tests drive, over our engine (asyncengine/compat/).
_COMPAT = "asyncengine.compat"
IMPORTS.update({
    ("vllm", "EngineArgs"): (f"{_COMPAT}.llm_engine", "EngineArgs"),
    ("vllm", "LLMEngine"): (f"{_COMPAT}.llm_engine", "LLMEngine"),
    ("vllm.engine.arg_utils", "EngineArgs"): (f"{_COMPAT}.llm_engine", "EngineArgs"),
    ("vllm.engine.arg_utils", "AsyncEngineArgs"): (f"{_COMPAT}.llm_engine", "AsyncEngineArgs"),
    ("vllm.engine.llm_engine", "LLMEngine"): (f"{_COMPAT}.llm_engine", "LLMEngine"),
    ("vllm.v1.engine.llm_engine", "LLMEngine"): (f"{_COMPAT}.llm_engine", "LLMEngine"),
    ("vllm.attention.selector", "get_attn_backend"): (f"{_COMPAT}.attention_selector", "get_attn_backend"),
    ("vllm.attention.backends.placeholder_attn", "PlaceholderAttentionBackend"):
        (f"{_COMPAT}.attention_selector", "PlaceholderAttentionBackend"),
    ("vllm.platforms", "_init_trace"): (f"{_COMPAT}.platforms", "_init_trace"),
})
# vLLM's loader contract: the model's config as a loader receives it, and its default loader (ours reads
# safetensors as vLLM's does; a subclass overriding load_weights or download_model works the same).
IMPORTS.update({
    ("vllm.config", "ModelConfig"): ("asyncengine.config.model", "ModelConfig"),
    ("vllm.config.model", "ModelConfig"): ("asyncengine.config.model", "ModelConfig"),
    ("vllm.model_executor.model_loader", "DefaultModelLoader"): (API, "SafetensorsLoader"),
    ("vllm.model_executor.model_loader.default_loader", "DefaultModelLoader"): (API, "SafetensorsLoader"),
})
# vLLM's helpers that plugins call: its logger, its tensor-parallel state and collectives, its small utilities.
_DISTRIBUTED = ["get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
                "get_tensor_model_parallel_group", "get_tp_group", "get_pp_group", "get_pipeline_model_parallel_rank",
                "get_pipeline_model_parallel_world_size", "tensor_model_parallel_all_reduce",
                "tensor_model_parallel_all_gather"]
_MATH = ["cdiv", "round_up", "round_down", "next_power_of_2"]
_HELPERS = {
    "vllm.logger": ("logger", ["init_logger"]),
    "vllm.distributed": ("distributed", _DISTRIBUTED),
    "vllm.distributed.parallel_state": ("distributed", _DISTRIBUTED),
    "vllm.distributed.communication_op": ("distributed", ["tensor_model_parallel_all_reduce",
                                                           "tensor_model_parallel_all_gather"]),
    "vllm.utils": ("utils", [*_MATH, "random_uuid", "get_ip", "get_open_port", "is_pin_memory_available"]),
    "vllm.utils.math_utils": ("utils", _MATH),
    "vllm.utils.network_utils": ("utils", ["get_ip", "get_open_port"]),
    "vllm.utils.platform_utils": ("utils", ["is_pin_memory_available"]),
    "vllm.model_executor.model_loader.weight_utils": ("weight_utils", [
        "safetensors_weights_iterator", "pt_weights_iterator", "filter_files_not_needed_for_inference",
        "filter_duplicate_safetensors_files"]),
    "vllm.model_executor.models": ("utils", ["is_pooling_model"]),
    "vllm.model_executor.models.interfaces_base": ("utils", ["is_pooling_model"]),
    "vllm.model_executor.layers.quantization": ("utils", ["QuantizationMethods"]),
    "vllm.config": ("compilation", ["CUDAGraphMode", "CompilationMode", "CompilationLevel"]),
    "vllm.config.compilation": ("compilation", ["CUDAGraphMode", "CompilationMode", "CompilationLevel"]),
    "vllm.utils.torch_utils": ("torch_utils", ["direct_register_custom_op", "set_default_torch_dtype",
                                               "current_stream"]),
    # `from vllm.envs import VLLM_LOGGING_LEVEL`: the flags asyncengine's envs answers
    "vllm.envs": ("envs", list(ENVS_ANSWERED)),
}
IMPORTS.update({(module, name): (f"{_COMPAT}.{target}", name)
                for module, (target, names) in _HELPERS.items() for name in names})
# vLLM's older home of it, beside vllm.utils' arithmetic
IMPORTS[("vllm.utils", "direct_register_custom_op")] = (f"{_COMPAT}.torch_utils", "direct_register_custom_op")
# vLLM's model-building layers, which a vLLM model file is written against: ours, in vLLM's shape (docs/porting.md,
# layers), imported from their home modules (they import torch).
_LAYERS = "asyncengine.models.layers"
_MODEL_LAYERS = {
    "vllm.model_executor.layers.linear": ("linear", ["ReplicatedLinear", "ColumnParallelLinear",
                                                     "MergedColumnParallelLinear", "QKVParallelLinear",
                                                     "RowParallelLinear", "set_weight_attrs"]),
    "vllm.model_executor.layers.vocab_parallel_embedding": ("embedding", ["VocabParallelEmbedding", "ParallelLMHead",
                                                                          "DEFAULT_VOCAB_PADDING_SIZE"]),
    "vllm.model_executor.layers.logits_processor": ("logits", ["LogitsProcessor"]),
    "vllm.model_executor.layers.rotary_embedding": ("rotary", ["get_rope"]),
    "vllm.model_executor.model_loader.weight_utils": ("linear", ["default_weight_loader"]),
    "vllm.model_executor.utils": ("linear", ["set_weight_attrs"]),
    "vllm.attention": ("vllm_attention", ["Attention"]),
    "vllm.attention.layer": ("vllm_attention", ["Attention"]),
}
IMPORTS.update({(module, name): (f"{_LAYERS}.{target}", name)
                for module, (target, names) in _MODEL_LAYERS.items() for name in names})
# vLLM environment variables that asyncengine reads under vLLM's name, left as they are by the tool.
ENVIRONMENT_VARIABLES_READ = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "LLMEngine/EngineArgs (asyncengine/compat/llm_engine.py): 0 runs the engine "
                                      "core in this process, 1 in a process of its own",
}
# `import vllm.envs as envs` (a module imported whole) -> `from OURS import NAME as envs`
MODULE_IMPORTS = {"vllm.envs": (API, "envs")}

# Class paths written as strings (vLLM's dotted form) -> ours.
CLASS_PATHS = {
    "vllm.v1.worker.gpu_worker.Worker": "asyncengine.worker.worker:Worker",
    "vllm.v1.worker.cpu_worker.CPUWorker": "asyncengine.worker.cpu_worker:CPUWorker",
    "vllm.platforms.cuda.NvmlCudaPlatform": "asyncengine.platforms.cuda:CudaPlatform",
    "vllm.worker.worker.Worker": "asyncengine.worker.worker:Worker",
    "vllm.v1.core.sched.scheduler.Scheduler": "asyncengine.engine_core.scheduler:Scheduler",
    "vllm.core.scheduler.Scheduler": "asyncengine.engine_core.scheduler:Scheduler",
    "vllm.v1.executor.uniproc_executor.UniProcExecutor": "asyncengine.engine_core.executor:UniExecutor",
    "vllm.v1.executor.multiproc_executor.MultiprocExecutor": "asyncengine.engine_core.executor:MultiprocExecutor",
    "vllm.platforms.cpu.CpuPlatform": "asyncengine.platforms.cpu:CpuPlatform",
    "vllm.platforms.cuda.CudaPlatform": "asyncengine.platforms.cuda:CudaPlatform",
}

# Attributes named by a dotted string, as `monkeypatch.setattr("vllm.plugins.load_plugins_by_group", fake)`
# names them: the attribute our code looks up when it is called, so that the same stub takes effect.
ATTRIBUTE_PATHS = {
    "vllm.plugins.load_plugins_by_group": "asyncengine.compat.plugins.load_plugins_by_group",
    "vllm.v1.metrics.loggers.load_plugins_by_group": "asyncengine.compat.plugins.load_plugins_by_group",
}

# What cannot be mapped, by vLLM module prefix (longest first wins): the docs/porting.md section.
UNMAPPED = [
    ("vllm.model_executor.layers", "custom-ops", "of the in-tree layers only RMSNorm, SiluAndMul, "
     "RotaryEmbedding and FusedMoE are exported"),
    ("vllm.attention", "attention-backends",
     "of vLLM's attention modules only the older selector's get_attn_backend and PlaceholderAttentionBackend are "
     "here; a descriptor subclassing AttentionBackend is accepted, and the class its get_impl_cls() returns "
     "implements forward(query, key, value, kv_cache, metadata)"),
    ("vllm.v1.attention", "attention-backends",
     "vLLM's backends, selector and metadata are not here; a descriptor subclassing AttentionBackend is "
     "accepted, and the class its get_impl_cls() returns implements forward(query, key, value, kv_cache, metadata)"),
    ("vllm.model_executor.models", "models", "asyncengine has no such model class"),
    ("vllm.model_executor.sampling_metadata", "models", "models here compute logits without sampling metadata"),
    ("vllm.inputs", "not-here-yet", "multimodal input registries do not exist here yet"),
    ("vllm.multimodal", "multimodal-models", "of vLLM's multimodal modules only MULTIMODAL_REGISTRY and the "
     "processor's three base classes map; a processor is written against BaseMultiModalProcessor's per-item methods"),
    ("vllm.assets", "not-here-yet", "vLLM's test assets are not part of asyncengine"),
    ("vllm.executor", "executors", "vLLM's v0 executors are gone; subclass Executor and name it in "
     "distributed_executor_backend"),
    ("vllm.plugins.set_executor_cls", "executors", "name the class in distributed_executor_backend instead"),
    ("vllm.entrypoints", "endpoint-plugins", "vLLM's server internals are not an interface here"),
    ("vllm.engine", "engine-arguments", "only EngineArgs, AsyncEngineArgs and LLMEngine map "
     "(asyncengine.compat.llm_engine); engine arguments are EngineConfig fields (LLM(**options))"),
    ("vllm.v1.engine", "engine-arguments", "only LLMEngine maps (asyncengine.compat.llm_engine); else use LLM "
     "or AsyncEngine"),
    ("vllm.utils", "the-table-of-names", "vLLM's utilities are not part of the plugin interface"),
    ("vllm", "the-table-of-names", "no counterpart in asyncengine.plugins_api"),
]


# Where a name the table has no row for may still be ours (the "provided by name" uses of the report).
PROVIDING_MODULES = (API, f"{_COMPAT}.logger", f"{_COMPAT}.distributed", f"{_COMPAT}.utils", f"{_COMPAT}.weight_utils",
                     f"{_COMPAT}.torch_utils", f"{_COMPAT}.compilation")


def provided_by_name(name: str) -> str | None:
    """Our module that exports `name` (one of PROVIDING_MODULES' __all__), for a vLLM import the table lacks;
    None when none does. The port rewrites such an import to it and reports it: the import works, and
    whether the object behaves as vLLM's is for the plugin's tests to show."""
    import importlib

    for module in PROVIDING_MODULES:
        if name in getattr(importlib.import_module(module), "__all__", ()):
            return module
    return None


def unmapped_reason(dotted: str) -> tuple[str, str]:
    """(docs section, hint) for a vLLM module or name the tables do not map."""
    for prefix, section, hint in UNMAPPED:
        if dotted == prefix or dotted.startswith(prefix + "."):
            return section, hint
    return "the-table-of-names", "no counterpart in asyncengine.plugins_api"


def rename_rows() -> list[tuple[str, str, str]]:
    """(kind, vLLM, asyncengine) for every rename the tool applies: docs/porting.md's table of names."""
    rows = [("entry-point group", old, new) for old, new in ENTRY_POINT_GROUPS.items()]
    rows += [("environment variable", old, new) for old, new in ENVIRONMENT_VARIABLES.items()]
    seen = set()
    for (module, name), (target, new_name) in IMPORTS.items():
        dotted = f"{module}.{name}"
        if dotted not in seen:
            seen.add(dotted)
            rows.append(("import", dotted, f"{target}.{new_name}"))
    rows += [("class path", old, new) for old, new in CLASS_PATHS.items()]
    rows += [("attribute path", old, new) for old, new in ATTRIBUTE_PATHS.items()]
    return rows
