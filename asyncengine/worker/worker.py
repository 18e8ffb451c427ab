"""Worker: owns one device (one tensor-parallel rank), the model shard on it and its KV cache.

The engine core drives it by method name (`init_device`, `load_model`, `determine_num_blocks`,
`initialize_kv_cache`, `execute_model`), in a thread of the engine-core process or in a process of
its own; `collective_rpc` reaches its other public methods the same way.
"""

from __future__ import annotations

import os
import time

import torch

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.platforms.interface import Platform
from asyncengine.wire.worker import ModelRunnerOutput, SchedulerOutput
from asyncengine.worker import parallel
from asyncengine.worker.model_runner import ModelRunner


class Worker:
    def __init__(
        self,
        engine_config: EngineConfig,
        model_config: ModelConfig | None,
        platform: type[Platform],
        *,
        rank: int = 0,
        world_size: int = 1,
        distributed_init_method: str | None = None,
    ) -> None:
        self.engine_config = engine_config
        self.model_config = model_config
        self.platform = platform
        self.rank = rank
        self.world_size = world_size
        self.distributed_init_method = distributed_init_method
        device_type = platform.device_type
        self.device = torch.device(device_type if device_type == "cpu" or world_size == 1 else f"{device_type}:{rank}")
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        self.platform.set_device(self.device)
        if self.device.type == "cpu" and self.world_size > 1:
            # Ranks share the machine's cores: without this each would start one thread per core.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
        parallel.initialize(self.rank, self.world_size, self.distributed_init_method, self.platform.dist_backend)
        self.platform.seed_everything(self.engine_config.seed)
        self.model_runner = ModelRunner(self.engine_config, self.model_config, self.device, self.platform)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        started = time.monotonic()
        output = self.model_runner.execute_model(scheduler_output)
        output.started_at, output.finished_at = started, time.monotonic()
        return output

    def shutdown(self) -> None:
        parallel.destroy()

    # -- for collective_rpc ----------------------------------------------------------------------------

    def describe(self) -> dict:
        """Who this worker is: rank, process, device, the model's parameter bytes on this rank."""
        model = self.model_runner.model if self.model_runner else None
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "device": str(self.device),
            "platform": self.platform.device_name,
            "architecture": self.model_config.architectures[0] if self.model_config else None,
            "model_class": f"{type(model).__module__}:{type(model).__qualname__}" if model else None,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()) if model else 0,
        }
