"""EngineConfig: every engine option, named as vLLM's engine arguments where one exists.

It is a msgspec Struct so that it crosses process boundaries as a msgpack frame, and so that the CLI can
derive one flag per field (`max_num_seqs` -> `--max-num-seqs`). Values are checked here, field by field;
checks that need the model (for example `max_model_len` against the model's context) live in
`asyncengine.config.model`.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from asyncengine.config.help import doc
from asyncengine.config.class_paths import classes_to_paths, is_class_path, struct_classes_to_paths
from asyncengine.config.vllm_views import VllmConfigViews
from asyncengine.errors import ConfigError
from asyncengine.config.kv_transfer import KVTransferConfig, parse_kv_transfer_config
from asyncengine.config.structured_outputs import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_COMPILE_TIMEOUT,
    DEFAULT_MAX_GRAMMAR_BYTES,
    DEFAULT_MAX_REGEX_BYTES,
    DEFAULT_MAX_SCHEMA_BYTES,
    check_structured_outputs_bounds,
    configured_backend_name,
)
from asyncengine.config.lora import check_lora_options
from asyncengine.config.multimodal import check_multimodal_options
from asyncengine.config.pooling import check_pooler_config, check_runner

# What `worker_cls="auto"` becomes: the built-in platforms' check_and_update_config set it.
BUILTIN_WORKER = "asyncengine.worker.worker:Worker"

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's names for two of them
# The built-in load formats; plugins add more (register_model_loader), checked once plugins are loaded.
# How messages reach the chat template (frontend/chat_messages.py): detected from it, or forced.
CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy values

# vLLM's --model-impl values (vLLM's "terratorch" has no counterpart here).
MODEL_IMPLS = ("auto", "native", "transformers")

# The KV cache on CPU has no device memory to measure, so it gets a fixed budget unless
# `kv_cache_memory_bytes` or `num_gpu_blocks_override` say otherwise (docs/configuration.md).
CPU_DEFAULT_KV_CACHE_BYTES = 2 * 1024**3


class EngineConfig(VllmConfigViews, msgspec.Struct, kw_only=True):
    """Options of one engine. All have defaults; `model=None` means the default model."""

    # Model and tokenizer
    model: Annotated[str | None, doc(
        "The model: a directory, a .gguf file or a name the loader knows; none: SmolLM2-135M-Instruct.")] = None
    # vLLM's --runner; with no model, pooling serves all-MiniLM-L6-v2.
    runner: Annotated[str, doc(
        "What the model is run for: generate, pooling (embeddings, classification, scoring) or auto (pooling "
        "for an architecture without a language-model head).")] = "auto"
    # Read in the frontend, built in the worker.
    pooler_config: Annotated[dict[str, Any] | None, doc(
        "The pooler, over what the model's files say: {\"pooling_type\": MEAN | CLS | LAST | ALL | a registered "
        "pooler, \"normalize\": true | false}.")] = None
    tokenizer: Annotated[str | None, doc(
        "A directory or ORG/NAME with the tokenizer's files; none: the model's.")] = None
    # vLLM's names (loader/hub.py, docs/configuration.md).
    revision: Annotated[str | None, doc(
        "The hub revision (branch, tag or commit) of an ORG/NAME model; none: main.")] = None
    tokenizer_revision: Annotated[str | None, doc(
        "The hub revision of an ORG/NAME tokenizer; none: main.")] = None
    hf_config_path: Annotated[str | None, doc(
        "A directory or ORG/NAME whose config.json replaces the model's.")] = None
    # A TokenizerRegistry key; plugins add modes. Read in the frontend.
    tokenizer_mode: Annotated[str, doc(
        "The tokenizer implementation: auto (transformers' AutoTokenizer) or a mode a plugin registered.")] = "auto"
    skip_tokenizer_init: Annotated[bool, doc(
        "Load no tokenizer: prompts must be token ids, outputs carry token ids and no text.")] = False
    # A list: the first name is the one responses report; requests may name any of them (vLLM's).
    served_model_name: Annotated[str | list[str] | None, doc(
        "The model name(s) the API serves; requests may use any, responses report the first; none: the "
        "model argument as given.")] = None
    dtype: Annotated[str, doc(
        "The weights' and activations' data type: auto, float32 (or float), bfloat16, float16 (or half).")] = "auto"
    seed: Annotated[int, doc("The seed of the random draws of requests that give no seed of their own.")] = 0
    # -1 (vLLM's `auto`) is read as None.
    max_model_len: Annotated[int | None, doc(
        "The longest sequence (prompt plus output) in tokens: 4096, 4k (4,000), 4K (4,096); auto or -1: the "
        "model's own.")] = None
    load_format: Annotated[str, doc(
        "How weights are read: auto, safetensors, gguf, dummy (random weights) or a loader a plugin "
        "registered.")] = "auto"
    # vLLM's --model-loader-extra-config: read by a plugin's loader (LoadConfig.model_loader_extra_config).
    model_loader_extra_config: Annotated[dict[str, Any] | None, doc(
        "Options for the model loader load_format names, as a JSON object; the built-in loaders take "
        "none.")] = None
    download_dir: Annotated[str | None, doc(
        "Where ORG/NAME models are downloaded (the hub cache) and converted GGUF models are cached; none: "
        "$HF_HUB_CACHE (or $HF_HOME/hub) and $ASYNCENGINE_CACHE_DIR or ~/.cache/asyncengine.")] = None
    generation_config: Annotated[str, doc(
        "auto: the model's generation_config.json supplies sampling defaults; vllm: ignore it.")] = "auto"
    chat_template: Annotated[str | None, doc(
        "A Jinja chat template, or a file holding one; none: the tokenizer's.")] = None
    chat_template_content_format: Annotated[str, doc(
        "How message content reaches the chat template: string, openai (a list of parts) or auto (detected "
        "from the template).")] = "auto"
    hf_overrides: Annotated[dict[str, Any], doc(
        "Keys merged into the model's config.json before the model is built.")] = msgspec.field(default_factory=dict)
    model_class_overrides: Annotated[dict[str, str], doc(
        "Architecture name to a model class, {\"Arch\": \"pkg.mod:Class\"}, over the registered "
        "one.")] = msgspec.field(default_factory=dict)
    quantization: Annotated[str | None, doc(
        "The quantization method of the linear layers: int8, int8_dynamic, gguf or one a plugin "
        "registered.")] = None
    # Passed to transformers where the model's config, tokenizer and (model_impl transformers) model are loaded.
    trust_remote_code: Annotated[bool, doc(
        "Let transformers run the Python code a model's or tokenizer's files ship (their configuration, "
        "tokenizer and, run through transformers, modelling classes).")] = False
    # vLLM's --model-impl (docs/models.md): the transformers backend, asyncengine/models/transformers_backend.py.
    model_impl: Annotated[str, doc(
        "Which implementation runs the model: native (ours; an architecture without one is an error), "
        "transformers (transformers' modelling code over our paged KV cache, TP=1) or auto (native where we "
        "have it, else transformers).")] = "auto"

    # Scheduling and KV cache
    max_num_seqs: Annotated[int, doc("The most sequences in one step's batch.")] = 256
    # vLLM's names and meaning (docs/server.md, "Priority"): with `priority`, a request's `priority` field
    # orders the waiting queue and chooses whom to preempt; with fcfs a nonzero priority is refused.
    scheduling_policy: Annotated[str, doc(
        "fcfs (first come, first served) or priority (a request's lower priority value is served first, "
        "ties by arrival; the highest value, latest arrival is preempted first).")] = "fcfs"
    max_num_batched_tokens: Annotated[int | None, doc(
        "The most tokens computed in one step (the token budget); none: 2048.")] = None
    enable_chunked_prefill: Annotated[bool, doc(
        "Split long prompts across steps; off, max_num_batched_tokens must be at least "
        "max_model_len.")] = True
    block_size: Annotated[int, doc("Tokens per KV-cache block: 1, 2, 4 or a multiple of 8.")] = 16
    enable_prefix_caching: Annotated[bool, doc("Reuse the KV blocks of a repeated prompt prefix.")] = True
    gpu_memory_utilization: Annotated[float, doc(
        "CUDA: the fraction of device memory the engine may use, in (0, 1].")] = 0.9
    kv_cache_memory_bytes: Annotated[int | None, doc(
        "The KV cache's size in bytes (4G, 512M), on any device; none: CPU 2 GiB, CUDA what "
        "gpu_memory_utilization leaves.")] = None
    num_gpu_blocks_override: Annotated[int | None, doc(
        "The KV cache's size in blocks (wins over the byte size; on CPU too).")] = None
    # Only "auto" is built: a clear error names what is asked for otherwise.
    kv_cache_dtype: Annotated[str, doc(
        "The KV cache's data type: auto (the model's dtype; the only one built here).")] = "auto"
    max_logprobs: Annotated[int, doc("The largest number of logprobs a request may ask for.")] = 20
    max_waiting_requests: Annotated[int, doc(
        "Requests waiting for the scheduler at once; beyond, requests are refused as overloaded (HTTP "
        "503).")] = 4096
    # More is a 400 naming n (docs/server.md, "Limits").
    max_n: Annotated[int, doc("The most completions one request may ask for (n).")] = 128

    # Placement and execution
    device: Annotated[str, doc(
        "The device: auto (an active platform plugin, else CUDA when usable, else CPU), cpu, cuda or a "
        "platform plugin's name.")] = "auto"
    enforce_eager: Annotated[bool, doc(
        "Run decode steps through the model's modules: on CUDA instead of replaying CUDA graphs, on CPU instead of "
        "the captured decode step of small batches (docs/performance.md).")] = False
    # vLLM's --attention-backend. Read in the worker; the name is checked in the frontend first.
    attention_backend: Annotated[str | None, doc(
        "The attention backend of every layer, by registered name (TORCH_PAGED, TRITON_PAGED, a plugin's) or "
        "pkg.mod:Class; none: the platform chooses.")] = None
    tensor_parallel_size: Annotated[int, doc("Ranks of tensor parallelism (one process each).")] = 1
    # Given and below the CPUs available, the model's threads are pinned and other threads kept off their
    # cores (worker/cpu_threads.py, docs/performance.md). Read in the worker.
    cpu_threads: Annotated[int | None, doc(
        "CPU: threads of the model's ops per worker; none: the process's CPUs less those other processes keep busy, "
        "shared among the workers, and followed as the load changes.")] = None
    # vLLM's --enable-expert-parallel (docs/distributed.md, "Expert parallelism"). Read in the worker; checked
    # against the model's expert count in the frontend (config/model.py).
    enable_expert_parallel: Annotated[bool, doc(
        "Mixture-of-experts models: split the experts over the tensor-parallel ranks (each rank holds whole "
        "experts) instead of every expert's matrices; each token goes to the ranks holding its experts and "
        "back. Needs tensor_parallel_size > 1.")] = False
    # One process per stage and tensor-parallel rank (docs/distributed.md).
    pipeline_parallel_size: Annotated[int, doc("Pipeline stages the model's layers are split over.")] = 1
    # Each with its own workers and KV cache (frontend/dp_router.py).
    data_parallel_size: Annotated[int, doc("Engine cores behind one frontend.")] = 1
    # Set by the frontend for each engine core it starts. Read in the worker: on CPU, the engine cores of
    # one host share its cores (worker/cpu_threads.py).
    data_parallel_rank: Annotated[int, doc(
        "Which of the data-parallel engine cores this is (set by the frontend).")] = 0
    distributed_executor_backend: Annotated[str | None, doc(
        "How workers run: uni (a thread of the engine core), mp (a process per rank), ray (a Ray actor per "
        "rank) or pkg.mod:Executor; none: uni for one rank, else mp.")] = None
    in_process: Annotated[bool, doc("Run the engine core in the caller's process (serve: its own).")] = True
    async_scheduling: Annotated[bool, doc("Schedule step N+1 while step N runs.")] = True
    # A Unix socket in a private directory, or TCP with a per-launch secret in the hand-shake.
    transport: Annotated[str, doc(
        "How the frontend reaches an engine core in its own process: unix or tcp.")] = "unix"

    # Extension hooks
    # Read in the engine core.
    scheduler_cls: Annotated[str | None, doc(
        "A Scheduler subclass, pkg.mod:Class, used instead of the built-in scheduler.")] = None
    # "auto": the platform's check_and_update_config sets it (the built-in platforms: the built-in Worker).
    # Read in the worker.
    worker_cls: Annotated[str, doc(
        "The worker class: auto (the platform's) or pkg.mod:Class, a subclass of "
        "asyncengine.plugins_api.Worker.")] = "auto"
    worker_extension_cls: Annotated[str, doc(
        "A class, pkg.mod:Class, built as Class(worker) in each worker (docs/hooks.md).")] = ""
    logits_processors: Annotated[list[str] | None, doc(
        "Logits-processor classes, pkg.mod:Class, applied to every request.")] = None
    kv_transfer_config: Annotated[dict[str, Any] | None, doc(
        "The KV connector: {\"kv_connector\", \"kv_role\", \"kv_connector_module_path\", "
        "\"kv_connector_extra_config\"}.")] = None
    # Read in the frontend and the engine core.
    structured_outputs_config: Annotated[dict[str, Any] | None, doc(
        "Structured outputs: {\"backend\": xgrammar | guidance | a registered name | auto}, the backend of "
        "requests that name none.")] = None
    # Structured outputs' bounds (docs/structured_outputs.md, "Bounds"). Read in the frontend (the source sizes)
    # and the engine core (the cache and the time limit).
    structured_outputs_cache_bytes: Annotated[int, doc(
        "The compiled-grammar cache's budget in bytes; the least recently used grammars are evicted past it.")] = \
        DEFAULT_CACHE_BYTES
    structured_outputs_compile_timeout: Annotated[float, doc(
        "Seconds one grammar compile may take before the request gets a 400 and the compile is killed.")] = \
        DEFAULT_COMPILE_TIMEOUT
    structured_outputs_max_schema_bytes: Annotated[int, doc(
        "The largest JSON schema (its JSON text, in bytes) a request may constrain its output with.")] = \
        DEFAULT_MAX_SCHEMA_BYTES
    structured_outputs_max_regex_bytes: Annotated[int, doc(
        "The largest regex (and whitespace_pattern), in bytes, a request may constrain its output with.")] = \
        DEFAULT_MAX_REGEX_BYTES
    structured_outputs_max_grammar_bytes: Annotated[int, doc(
        "The largest grammar or choice list (its JSON), in bytes, a request may constrain its output with.")] = \
        DEFAULT_MAX_GRAMMAR_BYTES
    additional_config: Annotated[dict[str, Any], doc(
        "Free-form options for platform plugins (vLLM's additional_config).")] = msgspec.field(default_factory=dict)
    # The worker checks the names (docs/custom_ops.md). Read in the worker.
    op_priority: Annotated[dict[str, list[str]], doc(
        "Op name to the op providers to try first, in order ({\"rms_norm\": [\"my_kernel\", \"native\"]}), "
        "over the platform's order.")] = msgspec.field(default_factory=dict)

    # Multi-LoRA serving (config/lora.py, docs/lora.md): vLLM's options.
    enable_lora: Annotated[bool, doc("Serve LoRA adapters.")] = False
    max_loras: Annotated[int, doc("The most adapters used in one step.")] = 1
    max_lora_rank: Annotated[int, doc("The largest adapter rank served.")] = 16
    max_cpu_loras: Annotated[int | None, doc(
        "Adapters kept read in each worker's CPU cache; none: max_loras.")] = None
    lora_modules: Annotated[list[str | dict[str, Any]] | None, doc(
        "Adapters served from the start: name=path, or JSON {\"name\", \"path\", \"base_model_name\"}; "
        "several values or the flag repeated.")] = None
    lora_resolver_dir: Annotated[str | None, doc(
        "The filesystem resolver's directory: one adapter per sub-directory, found by name on first use; "
        "none: $ASYNCENGINE_LORA_RESOLVER_CACHE_DIR.")] = None

    # Images in (config/multimodal.py, docs/multimodal.md): vLLM's names, and our bounds. Read in the frontend.
    limit_mm_per_prompt: Annotated[dict[str, Any], doc(
        "The most items of a modality one prompt may carry, as JSON: {\"image\": N}; default 16 images.")] = \
        msgspec.field(default_factory=dict)
    mm_processor_kwargs: Annotated[dict[str, Any] | None, doc(
        "Options for the model's multimodal processor, as JSON (e.g. {\"do_image_splitting\": false}).")] = None
    mm_processor_cache_gb: Annotated[float, doc(
        "GiB of processed images the frontend keeps by content hash (0: none).")] = 4.0
    allowed_local_media_path: Annotated[str, doc(
        "A folder whose files requests may name as file:// image URLs; empty: none.")] = ""
    allowed_media_domains: Annotated[list[str] | None, doc(
        "Hosts whose http(s) image URLs the server fetches (\"*\": any); none: no fetching.")] = None
    max_image_bytes: Annotated[int, doc("The most bytes of one encoded image.")] = 20 * 1024 * 1024
    max_image_pixels: Annotated[int, doc(
        "The most pixels (width x height) of one image, checked before it is decoded.")] = 4096 * 4096
    media_fetch_timeout: Annotated[float, doc("Seconds one image URL may take to fetch.")] = 5.0

    # Plugins and start-up
    plugins: Annotated[str | None, doc(
        "The plugin allow-list, comma-separated entry-point names; none: $ASYNCENGINE_PLUGINS, else every "
        "plugin but endpoint plugins; \"\": none.")] = None
    plugins_lenient: Annotated[bool, doc(
        "Record a plugin that fails and go on without it, instead of failing start-up.")] = False
    plugin_startup_timeout: Annotated[float, doc("Seconds one plugin may take to import and run.")] = 60.0
    startup_trace: Annotated[str | None, doc(
        "Write the start-up records of every process to this file (JSON).")] = None
    io_processor_plugin: Annotated[str | None, doc(
        "The IO-processor plugin POST /v1/io_process uses, by entry-point name.")] = None

    # Statistics
    stats_log_interval: Annotated[float, doc("Seconds between calls of every stat logger's log().")] = 10.0

    def __post_init__(self) -> None:
        struct_classes_to_paths(self)  # a class given as an object is kept as its path (class_paths.py)
        self._normalize_vllm_forms()
        self._check_ranges()
        self._check_choices()
        self._check_placement()
        # Keys and role here; the connector's name where the registry is read (engine core, workers).
        parse_kv_transfer_config(self.kv_transfer_config)
        configured_backend_name(self.structured_outputs_config)  # its shape here; the name where it is read
        check_structured_outputs_bounds(self)
        check_lora_options(self)
        check_runner(self.runner)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                              f"{self.scheduling_policy!r}", field="scheduling_policy")
        check_pooler_config(self.pooler_config)
        check_multimodal_options(self)

    def _normalize_vllm_forms(self) -> None:
        """vLLM's other spellings of a value, made ours: dtype half and float, max_model_len -1 (auto), one
        served model name given as a list."""
        if isinstance(self.dtype, str):
            self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.max_model_len == -1:
            self.max_model_len = None
        names = self.served_model_name
        if isinstance(names, list):
            if not names or not all(isinstance(name, str) and name for name in names):
                raise ConfigError(f"served_model_name must be a name or a non-empty list of names, got {names!r}",
                                  field="served_model_name")
            self.served_model_name = names[0] if len(names) == 1 else names

    @property
    def served_model_names(self) -> list[str]:
        """The names given to serve the model under (the first is the one reported); [] when none is."""
        names = self.served_model_name
        return list(names) if isinstance(names, list) else [names] if names else []

    def _check_ranges(self) -> None:
        positive = ("max_num_seqs", "block_size", "max_logprobs", "max_waiting_requests", "tensor_parallel_size",
                    "pipeline_parallel_size", "data_parallel_size", "max_n")
        for name in positive:
            if getattr(self, name) < 1 and not (name == "max_logprobs" and self.max_logprobs == 0):
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}", field=name)
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes", "num_gpu_blocks_override",
                     "cpu_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1 when given, got {value}", field=name)
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ConfigError(f"data_parallel_rank must be in [0, data_parallel_size={self.data_parallel_size}), got "
                              f"{self.data_parallel_rank}", field="data_parallel_rank")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
                field="gpu_memory_utilization",
            )
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}", field="seed")
        if not self.stats_log_interval > 0:  # written so that NaN fails too
            raise ConfigError(
                f"stats_log_interval must be > 0 seconds, got {self.stats_log_interval}", field="stats_log_interval"
            )

    def _check_choices(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)} (or vLLM's half, float); got {self.dtype!r}",
                              field="dtype")
        if self.kv_cache_dtype != "auto":
            raise ConfigError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not built here: the KV cache is stored in "
                              "the model's dtype, kv_cache_dtype auto (vLLM's fp8, fp8_e4m3 and fp8_e5m2 caches are "
                              "not implemented); leave it out or give auto", field="kv_cache_dtype")
        if not isinstance(self.load_format, str) or not self.load_format:
            raise ConfigError("load_format must name a model loader (auto, safetensors, gguf, dummy, or a "
                              "plugin's)", field="load_format")
        if not isinstance(self.tokenizer_mode, str) or not self.tokenizer_mode.strip():
            raise ConfigError("tokenizer_mode must name a registered tokenizer mode ('auto' or a plugin's)",
                              field="tokenizer_mode")
        if self.attention_backend is not None and not self.attention_backend.strip():
            raise ConfigError("attention_backend must name a registered attention backend (or be unset: the "
                              "platform chooses)", field="attention_backend")
        if not isinstance(self.op_priority, dict) or not all(
            isinstance(op, str) and isinstance(names, list) and all(isinstance(n, str) and n for n in names)
            for op, names in self.op_priority.items()
        ):
            raise ConfigError("op_priority must map op names to lists of provider names, as "
                              "{\"rms_norm\": [\"my_provider\", \"native\"]}", field="op_priority")
        if self.chat_template_content_format not in CHAT_TEMPLATE_CONTENT_FORMATS:
            raise ConfigError(f"chat_template_content_format must be one of "
                              f"{', '.join(CHAT_TEMPLATE_CONTENT_FORMATS)}, got {self.chat_template_content_format!r}",
                              field="chat_template_content_format")
        if self.model_impl not in MODEL_IMPLS:
            raise ConfigError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {self.model_impl!r}",
                              field="model_impl")
        if not self.device:
            raise ConfigError("device must be 'auto', a built-in platform (cpu, cuda) or a platform plugin's name",
                              field="device")
        if self.plugin_startup_timeout <= 0:
            raise ConfigError("plugin_startup_timeout must be positive", field="plugin_startup_timeout")
        if self.generation_config not in ("auto", "vllm"):
            raise ConfigError(
                "generation_config must be 'auto' (use the model's generation_config.json) or 'vllm' "
                f"(ignore it); got {self.generation_config!r}",
                field="generation_config",
            )
        if self.block_size % 8 != 0 and self.block_size not in (1, 2, 4):
            raise ConfigError(
                f"block_size must be 1, 2, 4 or a multiple of 8, got {self.block_size}", field="block_size"
            )

    def _check_placement(self) -> None:
        backend = self.distributed_executor_backend
        if backend not in (None, "uni", "mp", "ray") and not is_class_path(backend):
            raise ConfigError(
                f"distributed_executor_backend must be 'uni' (the worker in a thread of the engine-core "
                f"process), 'mp' (one process per rank), 'ray' (one Ray actor per rank, placed by a Ray "
                f"cluster) or 'pkg.mod:Class' (an Executor subclass); "
                f"got {backend!r}",
                field="distributed_executor_backend",
            )
        if backend == "uni" and self.world_size > 1:
            raise ConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_size="
                f"{self.pipeline_parallel_size} needs one process per rank: use distributed_executor_backend='mp' "
                "(the default with more than one rank)",
                field="distributed_executor_backend",
            )
        if self.enable_expert_parallel and self.tensor_parallel_size < 2:
            raise ConfigError(
                "enable_expert_parallel splits a mixture of experts over the tensor-parallel ranks, and "
                f"tensor_parallel_size is {self.tensor_parallel_size}: set tensor_parallel_size to 2 or more, or "
                "drop enable_expert_parallel", field="enable_expert_parallel")
        if self.worker_cls != "auto" and not is_class_path(self.worker_cls):
            raise ConfigError(
                f"worker_cls must be 'auto' (the platform chooses) or 'pkg.mod:Class' (a subclass of "
                f"asyncengine.plugins_api.Worker); got {self.worker_cls!r}",
                field="worker_cls",
            )
        if self.transport not in ("unix", "tcp"):
            raise ConfigError(f"transport must be 'unix' or 'tcp', got {self.transport!r}", field="transport")

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """`kv_transfer_config`, checked and typed (None: no KV connector)."""
        return parse_kv_transfer_config(self.kv_transfer_config)

    @property
    def executor_backend(self) -> str:
        """`distributed_executor_backend`, defaulted: 'uni' for one rank, else 'mp' (or a 'pkg.mod:Class')."""
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")

    @property
    def world_size(self) -> int:
        """The workers of one engine core: tensor_parallel_size x pipeline_parallel_size ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def effective_max_num_batched_tokens(self) -> int:
        """The per-step token budget: the option, else 2048 (vLLM's default with chunked prefill)."""
        return self.max_num_batched_tokens if self.max_num_batched_tokens is not None else 2048


def config_from_dict(values: dict[str, Any]) -> EngineConfig:
    """Build an EngineConfig from loose keyword values (LLM(**kwargs), a JSON frame), naming any bad field."""
    values = classes_to_paths(values)  # scheduler_cls=MyScheduler and the like (class_paths.py)
    known = {f.name for f in msgspec.structs.fields(EngineConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"unknown engine option(s): {', '.join(unknown)}; see `asyncengine generate --help` for the list",
            field=unknown[0],
        )
    try:
        return msgspec.convert(values, EngineConfig)
    except msgspec.ValidationError as exc:
        if isinstance(exc.__cause__, ConfigError):  # raised by our own checks in __post_init__
            raise exc.__cause__ from None
        # A type error from msgspec ends with "- at `$.field`": keep the field for the caller.
        _, _, path = str(exc).rpartition("at `$.")
        field = path.rstrip("`").split(".")[0].split("[")[0] or None
        raise ConfigError(f"invalid engine option: {exc}", field=field) from exc
