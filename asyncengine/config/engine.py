"""EngineConfig: every engine option, named as vLLM's engine arguments where one exists.

It is a msgspec Struct so that it crosses process boundaries as a msgpack frame, and so that the CLI can
derive one flag per field (`max_num_seqs` -> `--max-num-seqs`). Values are checked here, field by field;
checks that need the model (for example `max_model_len` against the model's context) live in
`asyncengine.config.model`.
"""

from __future__ import annotations

from typing import Any

import msgspec

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
from asyncengine.pooling.config import check_pooler_config, check_runner

# What `worker_cls="auto"` becomes: the built-in platforms' check_and_update_config set it.
BUILTIN_WORKER = "asyncengine.worker.worker:Worker"

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The built-in load formats; plugins add more (register_model_loader), checked once plugins are loaded.
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

# The KV cache on CPU has no device memory to measure, so it gets a fixed budget unless
# `kv_cache_memory_bytes` or `num_gpu_blocks_override` say otherwise (docs/configuration.md).
CPU_DEFAULT_KV_CACHE_BYTES = 2 * 1024**3


class EngineConfig(VllmConfigViews, msgspec.Struct, kw_only=True):
    """Options of one engine. All have defaults; `model=None` means the default model."""

    # Model and tokenizer
    model: str | None = None
    # vLLM's --runner: "generate", "pooling" (embeddings, classification, scoring: docs/pooling.md) or "auto"
    # (pooling for an architecture without a language-model head). With no model, pooling serves all-MiniLM-L6-v2.
    runner: str = "auto"
    # vLLM's --pooler-config ({"pooling_type": "MEAN" | "CLS" | "LAST" | "ALL" | a registered pooler,
    # "normalize": bool}), over what the model's files say. Read in the frontend, built in the worker.
    pooler_config: dict[str, Any] | None = None
    tokenizer: str | None = None
    # A TokenizerRegistry key ("auto": transformers' AutoTokenizer); plugins add modes. Read in the frontend.
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    served_model_name: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    load_format: str = "auto"
    download_dir: str | None = None
    generation_config: str = "auto"
    chat_template: str | None = None
    hf_overrides: dict[str, Any] = msgspec.field(default_factory=dict)
    model_class_overrides: dict[str, str] = msgspec.field(default_factory=dict)
    quantization: str | None = None

    # Scheduling and KV cache
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    max_logprobs: int = 20
    max_waiting_requests: int = 4096
    # The most completions one request may ask for (`n`); more is a 400 naming n (docs/server.md, "Limits").
    max_n: int = 128

    # Placement and execution
    device: str = "auto"
    enforce_eager: bool = False
    # A registered attention backend's name (or "pkg.mod:Class") for every layer, as vLLM's
    # --attention-backend; None: the platform's get_attn_backend_cls chooses. Read in the worker.
    attention_backend: str | None = None
    tensor_parallel_size: int = 1
    # Threads of the model's CPU ops per worker; None: the process's CPUs shared among the workers. Given
    # and below the CPUs available, the model's threads are pinned and other threads kept off their cores
    # (worker/cpu_threads.py, docs/performance.md). Read in the worker.
    cpu_threads: int | None = None
    # Layers split over this many stages (one process per stage and tensor-parallel rank: docs/distributed.md).
    pipeline_parallel_size: int = 1
    # Engine cores, each with its own workers and KV cache, behind one frontend (frontend/dp_router.py).
    data_parallel_size: int = 1
    # Which of those engine cores this is (vLLM's name): set by the frontend for each one it starts. Read in
    # the worker: on CPU, the engine cores of one host share its cores (worker/cpu_threads.py).
    data_parallel_rank: int = 0
    distributed_executor_backend: str | None = None
    in_process: bool = True
    async_scheduling: bool = True
    # How the frontend reaches an engine core in its own process: a Unix socket in a private
    # directory, or TCP (with a per-launch secret in the hand-shake).
    transport: str = "unix"

    # Extension hooks
    scheduler_cls: str | None = None  # "pkg.mod:Class", a Scheduler subclass; read in the engine core
    # "auto" (the platform's check_and_update_config sets it; the built-in platforms: the built-in Worker)
    # or "pkg.mod:Class", a subclass of asyncengine.plugins_api.Worker. Read in the worker.
    worker_cls: str = "auto"
    worker_extension_cls: str = ""  # "pkg.mod:Class", built as Class(worker) in each worker (docs/hooks.md)
    logits_processors: list[str] | None = None
    kv_transfer_config: dict[str, Any] | None = None
    # vLLM's --structured-outputs-config: {"backend": "xgrammar" | "guidance" | a registered name | "auto"}.
    # The default backend for requests that name none; read in the frontend and the engine core.
    structured_outputs_config: dict[str, Any] | None = None
    # Structured outputs' bounds (docs/structured_outputs.md, "Bounds"): the compiled-grammar cache's byte budget
    # (least recently used grammars evicted past it), the seconds one compile may take, and the size of a
    # constraint's source: a JSON schema's text, a regex (and a whitespace_pattern), a grammar or a choice
    # list's JSON. Read in the frontend (the sizes) and the engine core (the cache and the time limit).
    structured_outputs_cache_bytes: int = DEFAULT_CACHE_BYTES
    structured_outputs_compile_timeout: float = DEFAULT_COMPILE_TIMEOUT
    structured_outputs_max_schema_bytes: int = DEFAULT_MAX_SCHEMA_BYTES
    structured_outputs_max_regex_bytes: int = DEFAULT_MAX_REGEX_BYTES
    structured_outputs_max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    additional_config: dict[str, Any] = msgspec.field(default_factory=dict)
    # Op -> op-provider names to try first, in order ({"rms_norm": ["my_kernel", "native"]}), over the
    # platform's order (docs/custom_ops.md); the worker checks the names. Read in the worker.
    op_priority: dict[str, list[str]] = msgspec.field(default_factory=dict)

    # Multi-LoRA serving (config/lora.py, docs/lora.md): vLLM's options.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list[str | dict[str, Any]] | None = None
    lora_resolver_dir: str | None = None

    # Plugins and start-up
    plugins: str | None = None  # the allow-list; None: ASYNCENGINE_PLUGINS, else every plugin but endpoints
    plugins_lenient: bool = False  # record a failed plugin and go on, instead of failing start-up
    plugin_startup_timeout: float = 60.0  # seconds one plugin may take to import and run
    startup_trace: str | None = None  # write the start-up records of every process here (JSON)
    # The IO processor (entry-point name, asyncengine.io_processor_plugins) that POST /v1/io_process uses.
    io_processor_plugin: str | None = None

    # Statistics
    stats_log_interval: float = 10.0  # seconds between calls of every stat logger's log()

    def __post_init__(self) -> None:
        struct_classes_to_paths(self)  # a class given as an object is kept as its path (class_paths.py)
        self._check_ranges()
        self._check_choices()
        self._check_placement()
        # Keys and role here; the connector's name where the registry is read (engine core, workers).
        parse_kv_transfer_config(self.kv_transfer_config)
        configured_backend_name(self.structured_outputs_config)  # its shape here; the name where it is read
        check_structured_outputs_bounds(self)
        check_lora_options(self)
        check_runner(self.runner)
        check_pooler_config(self.pooler_config)

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
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}", field="dtype")
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
