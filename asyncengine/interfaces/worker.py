"""WorkerBase: what the engine core asks of a worker (`worker_cls`, docs/reference.md).

The engine core drives a worker by method name, in a thread of the engine-core process or in a process
of its own: `init_device`, `load_model`, `kv_cache_spec`, `determine_num_blocks`, `initialize_kv_cache`, `execute_model`,
`shutdown`; `collective_rpc` reaches its other public methods the same way, then those of its extension
(`worker_extension_cls`). The built-in Worker (asyncengine/worker/worker.py, torch) implements it, and a
plugin's `worker_cls` subclasses that one (asyncengine.plugins_api.Worker). This base names the
interface without torch, so code below the worker role can refer to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncengine.config.engine import EngineConfig
    from asyncengine.config.model import ModelConfig
    from asyncengine.interfaces.platform import Platform


class WorkerBase:
    # The public attributes, declared so that the worker-extension clash check sees them from the class
    # alone, before any worker exists.
    engine_config: EngineConfig
    model_config: ModelConfig
    platform: type[Platform]
    rank: int
    world_size: int
    distributed_init_method: str | None
    device: Any  # a torch.device
    model_runner: Any  # the worker's ModelRunner, None before init_device
    extension: Any  # the `worker_extension_cls` instance, built in init_device; None without one

    def init_device(self) -> None:
        raise NotImplementedError

    def load_model(self) -> list[dict[str, Any]]:
        """Load the model; this worker's start-up records (plain data) for the report."""
        raise NotImplementedError

    def kv_cache_spec(self) -> list[list[int | None]] | None:
        """`[layer index, sliding window or None]` per attention layer of this rank, from which the engine core
        builds the KV cache layout (asyncengine/wire/kv_cache.py); None: every layer attends over the whole
        context (one group)."""
        return None

    def determine_num_blocks(self, layout: Any = None) -> int:
        """How many KV blocks this rank can hold under `layout` (a KVCacheLayout or its dict form)."""
        raise NotImplementedError

    def initialize_kv_cache(self, num_blocks: int, layout: Any = None) -> list[dict[str, Any]] | None:
        """Allocate `num_blocks` KV blocks; may return start-up records (as dicts), as load_model does."""
        raise NotImplementedError

    def execute_model(self, scheduler_output: Any) -> Any:
        """One step: a SchedulerOutput in, a ModelRunnerOutput out (asyncengine.wire.worker)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


__all__ = ["WorkerBase"]
