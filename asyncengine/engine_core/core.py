"""EngineCore: one scheduler and its worker, stepped one batch at a time.

`step()` schedules a batch, has the worker compute it, and turns the sampled tokens into per-request
outputs. It knows nothing of text: detokenization and stop strings belong to the frontend.
"""

from __future__ import annotations

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.scheduler import Scheduler
from asyncengine.errors import ConfigError
from asyncengine.wire.engine_core import EngineCoreOutputs, EngineCoreRequest
from asyncengine.worker.worker import Worker


class EngineCore:
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, device: str) -> None:
        budget = engine_config.effective_max_num_batched_tokens
        if not engine_config.enable_chunked_prefill and budget < model_config.max_model_len:
            raise ConfigError(
                f"without chunked prefill a whole prompt must fit in one step: max_num_batched_tokens "
                f"({budget}) must be at least max_model_len ({model_config.max_model_len})",
                field="max_num_batched_tokens",
            )
        self.worker = Worker(engine_config, model_config, device)
        self.worker.init_device()
        self.worker.load_model()
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        self.scheduler = Scheduler(
            block_manager=BlockManager(num_blocks, engine_config.block_size, engine_config.enable_prefix_caching),
            max_num_seqs=engine_config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=model_config.max_model_len,
            enable_chunked_prefill=engine_config.enable_chunked_prefill,
        )

    @property
    def num_blocks(self) -> int:
        return self.scheduler.block_manager.num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not scheduler_output.finished_request_ids:
            return EngineCoreOutputs(scheduler_stats=self.scheduler.stats())
        runner_output = self.worker.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)
