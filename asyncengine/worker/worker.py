"""Worker: owns one device (one tensor-parallel rank), the model shard on it and its KV cache.

The engine core drives it by method name (`init_device`, `load_model`, `kv_cache_spec`, `determine_num_blocks`,
`initialize_kv_cache`, `execute_model`), in a thread of the engine-core process or in a process of
its own; `collective_rpc` reaches its other public methods the same way, and then the methods of its
extension (`worker_extension_cls`, composed: see worker/extension.py).

`worker_cls` names a subclass to build instead ("auto": the platform's choice; the built-in
platforms choose this class): `build_worker` (worker/build.py) builds it, in a worker process and in the uni
executor.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import torch

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.errors import StartupError
from asyncengine.models.layers import op_registry
from asyncengine.interfaces.platform import Platform
from asyncengine.platforms.torch_device import check_torch_device
from asyncengine.interfaces.plugin_code import plugin_hook
from asyncengine.interfaces.worker import WorkerBase
from asyncengine.lora.peft import LoRAAdapterError
from asyncengine.wire.kv_cache import KVCacheLayout
from asyncengine.wire.worker import ModelRunnerOutput, SchedulerOutput
from asyncengine import parallel_state as parallel
from asyncengine.worker import cpu_threads
from asyncengine.worker.extension import build_extension
from asyncengine.worker.model_runner import ModelRunner


class Worker(WorkerBase):
    # The public attributes, declared so that the worker-extension clash check (worker/extension.py)
    # sees them from the class alone, before any worker exists.
    engine_config: EngineConfig
    model_config: Any  # ModelConfig here; vLLM's view of it on a CPUWorker (worker/cpu_worker.py)
    resolved_model_config: ModelConfig  # the model as the frontend resolved it, whatever model_config shows
    platform: type[Platform]
    rank: int
    world_size: int
    distributed_init_method: str | None
    device: torch.device
    model_runner: ModelRunner | None
    extension: Any  # the `worker_extension_cls` instance, built in init_device; None without one

    def __init__(
        self,
        engine_config: EngineConfig,
        model_config: ModelConfig,
        platform: type[Platform],
        *,
        rank: int = 0,
        world_size: int = 1,
        distributed_init_method: str | None = None,
        logits_processors: tuple[type, ...] | list[type] = (),
    ) -> None:
        self.engine_config = engine_config
        self.model_config = model_config
        self.resolved_model_config = model_config
        self.platform = platform
        self.rank = rank
        self.world_size = world_size
        self.distributed_init_method = distributed_init_method
        device_type = platform.device_type
        if device_type is None:  # platform resolution checks it; a Worker built by hand may not
            raise StartupError(f"platform {platform.__qualname__} has no device_type (cpu, cuda, ...): set it")
        # An accelerator's device carries its index even alone (cuda:0, as vLLM passes it): torch.cuda.set_device
        # and the platforms modelled on it refuse a device without one.
        self.device = torch.device(device_type if device_type == "cpu" else f"{device_type}:{rank}")
        self.model_runner: ModelRunner | None = None  # built by init_device
        self._cpu_threads: cpu_threads.AppliedThreads | None = None  # set by init_device on CPU
        self._load_follower: cpu_threads.LoadFollower | None = None  # with the default cpu_threads on CPU
        self.extension = None
        # The logits-processor classes of this process's plugin phases (entry points and the
        # `logits_processors` option); the model runner builds them with the model.
        self._logits_processors = tuple(logits_processors)

    def init_device(self) -> None:
        with plugin_hook(self.platform, "set_device"):
            self.platform.set_device(self.device)
        check_torch_device(self.platform, self.device)  # a device torch has no backend for: named, here
        if self.device.type == "cpu":
            # How many threads the model uses, pinned when `cpu_threads` leaves CPUs spare (cpu_threads.py);
            # ranks share the machine's cores: without this each would start one thread per core.
            config = self.engine_config
            index, sharing = cpu_threads.local_workers(self.rank, self.world_size, config.data_parallel_rank,
                                                       config.data_parallel_size, config.distributed_executor_backend)
            cpus = cpu_threads.available_cpus()
            busy = cpu_threads.busy_cpus(cpus) if config.cpu_threads is None and len(cpus) > 1 else 0.0
            torch_default = torch.get_num_threads()
            self._cpu_threads = cpu_threads.apply(cpu_threads.plan_threads(
                config.cpu_threads, index, sharing, cpus, torch_default, busy))
            if config.cpu_threads is None and len(cpus) > 1:  # the default follows the load as it changes
                self._load_follower = cpu_threads.LoadFollower(cpus, sharing, torch_default)
        parallel.initialize(self.rank, self.world_size, self.distributed_init_method, self.platform.dist_backend,
                            pipeline_parallel_size=self.engine_config.pipeline_parallel_size,
                            expert_parallel=self.engine_config.enable_expert_parallel)
        with plugin_hook(self.platform, "seed_everything"):
            self.platform.seed_everything(self.engine_config.seed)
        self.model_runner = ModelRunner(self.engine_config, self.resolved_model_config, self.device, self.platform,
                                        self._logits_processors)
        if self.engine_config.worker_extension_cls:
            # Built here, inside the traced `init device` phase, so a constructor that raises is
            # reported with this worker and phase named; the model loads later, so an extension reads
            # the worker's state when its methods are called, not in its constructor.
            self.extension = build_extension(self, self.engine_config.worker_extension_cls)

    def load_model(self) -> list[dict[str, Any]]:
        """Load the model; returns this worker's start-up records of what it chose (as plain data, the
        same whether it crosses a process boundary or not), which the engine core adds to the report."""
        # Before the model exists: its custom ops choose their op provider per call, in this order.
        op_registry.set_op_priority(self.engine_config.op_priority)
        runner = self._runner()
        runner.load_model()
        return msgspec.to_builtins(runner.startup_records + op_registry.startup_records("load model"))

    def kv_cache_spec(self) -> list[list[int | None]]:
        """`[layer index, sliding window or None]` of each attention layer of this rank."""
        return self._runner().kv_cache_spec()

    def determine_num_blocks(self, layout: Any = None) -> int:
        """The KV blocks this rank can hold under the engine core's layout (a KVCacheLayout, or the dict a
        worker process decodes it into; None: one group of every layer)."""
        return self._runner().determine_num_blocks(as_kv_cache_layout(layout))

    def initialize_kv_cache(self, num_blocks: int, layout: Any = None) -> list[dict[str, Any]]:
        """Allocate the KV cache (on CPU after a warm-up pass that builds the C kernels); returns this
        worker's start-up records of its size and of the kernels, as load_model does."""
        runner = self._runner()
        runner.initialize_kv_cache(num_blocks, as_kv_cache_layout(layout))
        return msgspec.to_builtins(runner.kv_cache_records)

    def speculative_kv_cache_usage(self) -> dict[str, int] | None:
        """The speculative proposer's own KV cache (a draft model's, an EAGLE head's): `num_blocks`,
        `num_free_blocks`, `num_requests` held; None without one."""
        spec_decoder = self._runner().spec_decoder
        return spec_decoder.proposer.kv_cache_usage() if spec_decoder is not None else None

    def execute_model(self, scheduler_output: SchedulerOutput, grammar: Any = None) -> ModelRunnerOutput:
        """One step; `grammar`: its deferred masks (ModelRunner.execute_model), from an in-process executor."""
        started = time.monotonic()
        if self._load_follower is not None:
            self._load_follower.poll()
        runner = self._runner()
        output = runner.execute_model(scheduler_output, grammar)
        output.started_at, output.finished_at = started, time.monotonic()
        output.expert_tokens = runner.expert_load.totals()
        return output

    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError(f"worker rank {self.rank}: init_device() builds the model runner, and has not run")
        return self.model_runner

    def shutdown(self) -> None:
        parallel.destroy()
        if self._cpu_threads is not None:
            cpu_threads.restore(self._cpu_threads)
            self._cpu_threads = None

    # -- for collective_rpc ----------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Who this worker is: rank, process, device, the model's parameter bytes on this rank."""
        model = self.model_runner.model if self.model_runner else None
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "device": str(self.device),
            "platform": self.platform.device_name,
            "architecture": self.resolved_model_config.architectures[0],
            "model_class": f"{type(model).__module__}:{type(model).__qualname__}" if model else None,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()) if model else 0,
            # MoE models: [first, end) of the experts this rank holds, per distinct range over the MoE layers
            # (all of them, unless expert parallelism splits them).
            "local_experts": [list(span) for span in sorted(
                {(layer.first_expert, layer.first_expert + layer.num_local_experts)
                 for layer in self.model_runner.expert_load.layers})] if self.model_runner else [],
            "cpu_threads": cpu_threads.report(self._cpu_threads),  # on CPU: threads and CPUs of this thread
        }

    def check_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any] | None:
        """Whether the adapter at `lora_path` fits this rank's model (lora/pool.py `check`: its config and
        every matrix's shape, from the safetensors header; no slot taken): None, or {"message", "field"}
        naming the adapter, the layer and both shapes. The frontend asks before it registers a name."""
        lora = self.model_runner.lora if self.model_runner else None
        if lora is None:
            return {"message": "this engine was started without enable_lora: it serves no adapters",
                    "field": "enable_lora"}
        try:
            lora.check(lora_name, lora_path)
        except LoRAAdapterError as exc:
            return {"message": str(exc), "field": exc.field}
        return None

    def lora_info(self) -> dict[str, Any] | None:
        """The LoRA pool of this rank (slots, CPU cache, pool bytes: lora/pool.py), None without enable_lora."""
        lora = self.model_runner.lora if self.model_runner else None
        return lora.info() if lora is not None else None


def as_kv_cache_layout(layout: Any) -> KVCacheLayout | None:
    """The engine core's KV-cache layout as a KVCacheLayout (a worker process receives it as a dict)."""
    if layout is None or isinstance(layout, KVCacheLayout):
        return layout
    return msgspec.convert(layout, KVCacheLayout)
