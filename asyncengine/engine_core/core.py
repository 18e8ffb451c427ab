"""EngineCore: the scheduler and the executor that runs its steps, started in order.

Start-up: the executor brings its workers up (threads or processes), they load the model, the
smallest KV-cache size any rank can hold is allocated on all of them, and the scheduler is built
around that many blocks. The step loop that drives the core lives in `engine_core/loop.py`.
"""

from __future__ import annotations

from anyio.abc import TaskGroup

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.executor import Executor, build_executor
from asyncengine.engine_core.scheduler import Scheduler
from asyncengine.errors import ConfigError


class EngineCore:
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, executor: Executor, num_blocks: int) -> None:
        self.engine_config = engine_config
        self.model_config = model_config
        self.executor = executor
        self.scheduler = Scheduler(
            block_manager=BlockManager(num_blocks, engine_config.block_size, engine_config.enable_prefix_caching),
            max_num_seqs=engine_config.max_num_seqs,
            max_num_batched_tokens=engine_config.effective_max_num_batched_tokens,
            max_model_len=model_config.max_model_len,
            enable_chunked_prefill=engine_config.enable_chunked_prefill,
        )

    @property
    def num_blocks(self) -> int:
        return self.scheduler.block_manager.num_blocks

    @classmethod
    async def start(
        cls, engine_config: EngineConfig, model_config: ModelConfig, device: str, task_group: TaskGroup, *, owner: str
    ) -> "EngineCore":
        check_budget(engine_config, model_config)
        executor = build_executor(engine_config, model_config, device, owner=owner)
        try:
            await executor.start(task_group)
            num_blocks = await executor.start_workers()
        except BaseException:
            await executor.shutdown()
            raise
        return cls(engine_config, model_config, executor, num_blocks)


def check_budget(engine_config: EngineConfig, model_config: ModelConfig) -> None:
    budget = engine_config.effective_max_num_batched_tokens
    if not engine_config.enable_chunked_prefill and budget < model_config.max_model_len:
        raise ConfigError(
            f"without chunked prefill a whole prompt must fit in one step: max_num_batched_tokens "
            f"({budget}) must be at least max_model_len ({model_config.max_model_len})",
            field="max_num_batched_tokens",
        )
