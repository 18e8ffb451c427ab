"""CPUWorker: vLLM's CPU worker's name and shape, over this engine's Worker, for a platform's `worker_cls` to
subclass as vLLM's platform plugins subclass `vllm.v1.worker.cpu_worker.CPUWorker`.

vLLM builds a worker as `Worker(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)` and
drives it by vLLM's method names; this engine builds it and drives it by its own (worker/worker.py). This
class speaks both: `build_worker` sees a CPUWorker subclass and builds it with vLLM's arguments (the
rest, the resolved model and the platform, it reads from the build it is part of), and the engine's calls
go through vLLM's methods, so that a subclass overriding one of them is called where vLLM would call it:

| the engine core asks      | CPUWorker calls (override these)                                  |
|---------------------------|-------------------------------------------------------------------|
| init_device()             | init_device()                                                     |
| load_model()              | load_model()                                                      |
| determine_num_blocks()    | determine_available_memory() -> bytes, divided by a block's bytes |
| initialize_kv_cache(n)    | initialize_from_config(KVCacheConfig(num_blocks=n, ...)), then compile_or_warm_up_model() |
| execute_model(output)     | execute_model(scheduler_output)                                   |

Attributes are vLLM's: `vllm_config` (the EngineConfig, with vLLM's sub-config views), `model_config`,
`parallel_config`, `scheduler_config`, `cache_config`, `device_config`, `load_config`,
`compilation_config` (those views: resolved values, and the model's questions such as
`model_config.get_head_size()`), `local_rank`, `rank`, `distributed_init_method`, `is_driver_worker`,
and `model_runner` once `init_device` has built it (this engine's runner, not vLLM's). Each call the
engine makes into a subclass's override is named when it raises (plugin_runtime/plugin_code.py).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from asyncengine.errors import StartupError
from asyncengine.interfaces.plugin_code import plugin_hook
from asyncengine.worker.worker import Worker, as_kv_cache_layout

if TYPE_CHECKING:
    from asyncengine.interfaces.platform import Platform
    from asyncengine.config.model import ModelConfig


@dataclass
class KVCacheConfig:
    """vLLM's KV-cache plan as `initialize_from_config` receives it: the blocks to allocate (the engine core
    chose the smallest number every rank can hold), and their size in tokens."""

    num_blocks: int
    block_size: int
    kv_cache_tensors: list[Any] = field(default_factory=list)  # vLLM's per-layer tensors: the runner allocates
    kv_cache_groups: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class _Build:
    """What build_worker knows that vLLM's constructor does not carry."""

    model_config: ModelConfig
    platform: type[Platform]
    world_size: int
    logits_processors: tuple[type, ...]


_building: contextvars.ContextVar[_Build | None] = contextvars.ContextVar("asyncengine_worker_build", default=None)


@contextmanager
def building(model_config: ModelConfig, platform: type[Platform], *, world_size: int,
             logits_processors: Any) -> Iterator[None]:
    """While build_worker builds a CPUWorker subclass with vLLM's arguments: the rest of what it needs."""
    token = _building.set(_Build(model_config, platform, world_size, tuple(logits_processors)))
    try:
        yield
    finally:
        _building.reset(token)


class CPUWorker(Worker):
    def __init__(self, vllm_config: Any, local_rank: int, rank: int, distributed_init_method: str | None,
                 is_driver_worker: bool = False) -> None:
        build = _building.get()
        if build is None:
            raise StartupError(f"{type(self).__qualname__} is built by the engine, from the worker_cls option (or a "
                               "platform's check_and_update_config setting parallel_config.worker_cls), not by hand")
        super().__init__(vllm_config, build.model_config, build.platform, rank=rank, world_size=build.world_size,
                         distributed_init_method=distributed_init_method, logits_processors=build.logits_processors)
        # vLLM's attribute names: the config and its sub-config views (config/vllm_views.py).
        self.vllm_config = vllm_config
        self.local_rank = local_rank
        self.is_driver_worker = is_driver_worker
        self.model_config = vllm_config.model_config
        self.parallel_config = vllm_config.parallel_config
        self.scheduler_config = vllm_config.scheduler_config
        self.cache_config = vllm_config.cache_config
        self.device_config = vllm_config.device_config
        self.load_config = vllm_config.load_config
        self.compilation_config = vllm_config.compilation_config
        self.lora_config = None
        self.speculative_config = None

    # -- vLLM's methods: a subclass overrides these --------------------------------------------------------

    def determine_available_memory(self) -> int:
        """The bytes the KV cache may take on this rank (kv_cache_memory_bytes, num_gpu_blocks_override, or
        the CPU's default budget, as a whole number of blocks)."""
        return Worker.determine_num_blocks(self) * self._bytes_per_block()

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV cache as the engine core planned it."""
        Worker.initialize_kv_cache(self, kv_cache_config.num_blocks)

    def compile_or_warm_up_model(self) -> float:
        """vLLM compiles and warms the model up here; this engine's CPU path runs eagerly: nothing to do.
        Returns the seconds spent compiling (vLLM's newer return value)."""
        return 0.0

    def get_model(self) -> Any:
        return self._runner().model

    def check_health(self) -> None:
        """vLLM's liveness probe: a worker that answers is alive."""

    def get_supported_tasks(self) -> tuple[str, ...]:
        runner = self.resolved_model_config.runner
        return ("encode", "embed") if runner == "pooling" else ("generate",)

    # -- the engine core's calls, through vLLM's methods ------------------------------------------------------

    def determine_num_blocks(self, layout: Any = None) -> int:
        self._set_layout(layout)
        with plugin_hook(self, "determine_available_memory"):
            available = int(self.determine_available_memory())
        per_block = self._bytes_per_block()
        if per_block == 0:  # a model without KV caches (an encoder): block ids without memory
            return Worker.determine_num_blocks(self)
        if available < per_block:
            raise StartupError(f"{type(self).__qualname__}.determine_available_memory() left {available} bytes for "
                               f"the KV cache on rank {self.rank}, less than one block ({per_block} bytes)")
        return available // per_block

    def initialize_kv_cache(self, num_blocks: int, layout: Any = None) -> list[dict[str, Any]]:
        self._set_layout(layout)
        config = KVCacheConfig(num_blocks=num_blocks, block_size=self.engine_config.block_size)
        with plugin_hook(self, "initialize_from_config"):
            self.initialize_from_config(config)
        with plugin_hook(self, "compile_or_warm_up_model"):
            self.compile_or_warm_up_model()
        return msgspec.to_builtins(self.model_runner.kv_cache_records if self.model_runner else [])

    def _set_layout(self, layout: Any) -> None:
        """The engine core's KV-cache layout (its groups of layers), kept by the runner for vLLM's methods,
        which do not carry it."""
        if layout is not None:
            self._runner().set_kv_cache_layout(as_kv_cache_layout(layout))

    def _bytes_per_block(self) -> int:
        runner = self._runner()
        return runner.kv_cache_bytes_per_block() if runner.attention_layers else 0


def is_vllm_shaped(cls: type) -> bool:
    """Whether build_worker builds `cls` with vLLM's constructor arguments."""
    return isinstance(cls, type) and issubclass(cls, CPUWorker)


__all__ = ["CPUWorker", "KVCacheConfig", "building", "is_vllm_shaped"]
