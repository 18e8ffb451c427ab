"""Worker: owns one device, the model on it and its KV cache; executes the steps the engine core schedules."""

from __future__ import annotations

import random

import numpy as np
import torch

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.wire.worker import ModelRunnerOutput, SchedulerOutput
from asyncengine.worker.model_runner import ModelRunner


class Worker:
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, device: str) -> None:
        self.engine_config = engine_config
        self.model_config = model_config
        self.device = torch.device(device)
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        seed = self.engine_config.seed
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self.model_runner = ModelRunner(self.engine_config, self.model_config, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
