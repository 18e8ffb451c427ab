"""Building the worker of a rank: the class `worker_cls` names (the built-in Worker by default), with this
engine's constructor arguments, or with vLLM's for a subclass of the vLLM-shaped CPUWorker
(worker/cpu_worker.py). Its constructor raising is named with the plugin's distribution and the process."""

from __future__ import annotations

from typing import Any

from asyncengine.config.engine import BUILTIN_WORKER, EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.config.vllm_views import remember_resolved_model
from asyncengine.interfaces.platform import Platform
from asyncengine.interfaces.plugin_code import plugin_hook
from asyncengine.interfaces.registry import reads
from asyncengine.worker.cpu_worker import building, is_vllm_shaped
from asyncengine.worker.worker import Worker


@reads("hook:worker_cls", "worker")
def build_worker(engine_config: EngineConfig, model_config: ModelConfig, platform: type[Platform], *,
                 rank: int = 0, world_size: int = 1, distributed_init_method: str | None = None,
                 logits_processors: tuple[type, ...] | list[type] = ()) -> Worker:
    """The worker of this rank: the class `worker_cls` names. The config-hooks phase of this process
    checked that it is a Worker subclass ("auto", which a platform that does not set it leaves, is the
    built-in Worker)."""
    path = engine_config.worker_cls
    cls: type[Worker] = Worker
    if path not in ("auto", BUILTIN_WORKER):
        from asyncengine.plugin_runtime.config_hooks import load_hook

        cls = load_hook("worker_cls", path)
    remember_resolved_model(engine_config.model, model_config)  # vLLM's config views show the resolved model
    with plugin_hook(cls, "__init__"):
        if is_vllm_shaped(cls):  # vLLM's constructor: Worker(vllm_config, local_rank, rank, init_method, driver)
            with building(model_config, platform, world_size=world_size, logits_processors=logits_processors):
                return cls(vllm_config=engine_config, local_rank=rank, rank=rank,  # type: ignore[call-arg]
                           distributed_init_method=distributed_init_method, is_driver_worker=rank == 0)
        return cls(engine_config, model_config, platform, rank=rank, world_size=world_size,
                   distributed_init_method=distributed_init_method, logits_processors=logits_processors)


__all__ = ["build_worker"]
