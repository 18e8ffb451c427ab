"""EngineCore: the scheduler and the executor that runs its steps, started in order.

Start-up phases (recorded in the engine core's StartupTrace): `start workers` (threads or processes;
worker processes run their own plugin phases and send their records), `load model`, `kv cache` (the
smallest size any rank can hold, allocated on all of them). The step loop lives in `loop.py`.
"""

from __future__ import annotations

from typing import Any

from anyio.abc import TaskGroup

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.executor import Executor, build_executor
from asyncengine.engine_core.scheduler import Scheduler
from asyncengine.errors import ConfigError
from asyncengine.plugin_runtime.records import StartupTrace


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
        cls,
        engine_config: EngineConfig,
        model_config: ModelConfig | None,
        plugin_state: Any,
        task_group: TaskGroup,
        *,
        trace: StartupTrace,
        frontend_manifest: Any = None,
    ) -> "EngineCore | None":
        """The started core; None for a `plugins check` start (`model_config` None), which only starts
        and checks the workers."""
        if model_config is not None:
            check_budget(engine_config, model_config)
        executor = build_executor(engine_config, model_config, plugin_state, owner=trace.process)
        try:
            async with trace.phase("start workers"):
                await executor.start(task_group, trace=trace, manifest=frontend_manifest)
            if model_config is None:
                await executor.shutdown()
                return None
            async with trace.phase("load model"):
                await executor.call("load_model")
            async with trace.phase("kv cache"):
                num_blocks = min(await executor.call("determine_num_blocks"))
                await executor.call("initialize_kv_cache", num_blocks)
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
