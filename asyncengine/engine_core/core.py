"""EngineCore: the scheduler (`Scheduler`, or the SchedulerInterface `scheduler_cls` names, built with
its helpers: interfaces/scheduler.py) and the executor that runs its steps, started in order.

Start-up phases (recorded in the engine core's StartupTrace): `kv connector` (only when kv_transfer_config
names one: its scheduler side), `start workers` (threads or processes; worker processes run their own
plugin phases and send their records), `load model`, `kv cache` (the smallest size any rank can hold,
allocated on all of them; the scheduler), each a step of `run_engine_core`, which the process entry (or
the in-process client) starts with `await tg.start(...)`. The step loop lives in `loop.py`; `plugins
check` does not come here (check.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskStatus

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.config.speculative import check_against_engine
from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.interfaces.executor import Executor
from asyncengine.engine_core.executor import build_executor
from asyncengine.engine_core.micro_batches import micro_batches_for
from asyncengine.engine_core.scheduler import Scheduler
from asyncengine.errors import ConfigError, StartupError
from asyncengine.interfaces.kv_connector import KVConnectorBase, KVConnectorRole
from asyncengine.interfaces.scheduler import SchedulerInterface
from asyncengine.kv_transfer.factory import connector_record, context_for, create_connector
from asyncengine.wire.startup import StartupRecord
from asyncengine.plugin_runtime.records import StartupTrace
from asyncengine.interfaces.registry import reads
from asyncengine.runtime.groups import single_exceptions
from asyncengine.structured_output.manager import StructuredOutputManager
from asyncengine.wire.kv_cache import KVCacheLayout, build_layout

logger = logging.getLogger(__name__)


class EngineCore:
    """The scheduler and what the step loop needs beside it: the executor, the KV-cache blocks, the
    structured-output manager (grammars compile in the step loop's task group) and the micro-batch rules."""

    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, executor: Executor,
                 block_manager: BlockManager, kv_connector: KVConnectorBase | None = None) -> None:
        self.engine_config = engine_config
        self.model_config = model_config
        self.executor = executor
        self.block_manager = block_manager
        # Structured outputs: grammars are compiled and masks computed here; backends load lazily.
        self.structured_output = StructuredOutputManager(
            tokenizer_dir=model_config.tokenizer_dir, vocab_size=model_config.vocab_size,
            eos_token_ids=model_config.eos_token_ids,
            structured_outputs_config=engine_config.structured_outputs_config,
            trust_remote_code=engine_config.trust_remote_code,
            cache_bytes=engine_config.structured_outputs_cache_bytes,
            compile_timeout=engine_config.structured_outputs_compile_timeout,
        )
        # Pipeline stages with async scheduling: micro-batches that overlap (micro_batches.py).
        self.micro_batches = micro_batches_for(engine_config, executor.platform.device_type)
        # `scheduler_cls` replaces the class only: async scheduling is the step loop's (loop.py), so any
        # scheduler keeps it. The config-hooks phase of this process checked the class already.
        self.scheduler: SchedulerInterface = scheduler_class(engine_config)(
            block_manager=block_manager,
            max_num_seqs=engine_config.max_num_seqs,
            max_num_batched_tokens=engine_config.effective_max_num_batched_tokens,
            max_model_len=model_config.max_model_len,
            enable_chunked_prefill=engine_config.enable_chunked_prefill,
            policy=engine_config.scheduling_policy,
            structured_output=self.structured_output,
            kv_connector=kv_connector,
            # Multi-LoRA: a step never uses more adapters than each worker has slots.
            max_loras=engine_config.max_loras if engine_config.enable_lora else None,
            micro_batches=self.micro_batches,
        )
        speculative = engine_config.speculative
        if speculative is not None:
            if not isinstance(self.scheduler, Scheduler):
                raise ConfigError(f"speculative_config needs the built-in Scheduler or a subclass (it schedules "
                                  f"k + 1 tokens and rolls back rejected drafts); scheduler_cls "
                                  f"{engine_config.scheduler_cls} is not one", field="scheduler_cls")
            self.scheduler.enable_speculation(speculative.num_speculative_tokens)

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks


async def run_engine_core(engine_config: EngineConfig, model_config: ModelConfig, plugin_state: Any,
                          trace: StartupTrace, frontend_manifest: Any = None, *,
                          task_status: TaskStatus[EngineCore] = anyio.TASK_STATUS_IGNORED) -> None:
    """The engine core's start-up phases, then the task that owns its executor: `task_status.started(core)`
    once the KV cache is allocated; returns once the executor has shut down (the step loop shuts it
    down as it ends). A failed phase shuts the workers down and raises."""
    check_budget(engine_config, model_config)
    connector = None
    kv_transfer = engine_config.kv_transfer
    if kv_transfer is not None:
        # The KV connector's scheduler side, before any worker starts: an unknown connector fails
        # here, named; the scheduler gets it once the KV cache is allocated.
        async with trace.phase("kv connector"):
            started = time.time()
            connector, choice = create_connector(kv_transfer, KVConnectorRole.SCHEDULER,
                                                 context_for(engine_config, model_config))
            trace.extend([connector_record(connector, choice, phase="kv connector", started=started)])
    executor = build_executor(engine_config, model_config, plugin_state, owner=trace.process)
    with single_exceptions():  # a failed phase, not a group around it
        async with anyio.create_task_group() as tg:  # owns the executor's task, and no more
            async with trace.phase("start workers"):
                # A serve that fails before it has started has stopped what it started.
                await tg.start(executor.serve, trace, frontend_manifest)
            try:
                async with trace.phase("load model"):
                    # Each rank answers with its records of what it chose (attention backend, ...).
                    for records in await executor.call("load_model"):
                        trace.extend(msgspec.convert(records or [], list[StartupRecord]))
                async with trace.phase("kv cache"):
                    layout = kv_cache_layout(await executor.call("kv_cache_spec"))
                    if connector is not None and layout.has_sliding_window:
                        raise ConfigError("kv_transfer_config: KV connectors move every block of a request's one block "
                                          "table, and this model's sliding-window layers keep only their window's "
                                          f"blocks ({len(layout.groups)} KV cache group(s)); serve it without a KV "
                                          "connector", field="kv_transfer_config")
                    num_blocks = min(await executor.call("determine_num_blocks", layout))
                    # Each rank answers with its records (the cache's size, the C kernels its warm-up built).
                    for records in await executor.call("initialize_kv_cache", num_blocks, layout):
                        trace.extend(msgspec.convert(records or [], list[StartupRecord]))
                    # An object per block: 74 ms for 200k blocks, 1.2 s for 2M (a GPU's cache), so off the
                    # event loop, which an in-process engine shares with its caller.
                    block_manager = await anyio.to_thread.run_sync(
                        BlockManager, num_blocks, engine_config.block_size, engine_config.enable_prefix_caching,
                        layout.sliding_windows)
                    # The scheduler (with the block manager over these blocks) is built in this phase, so
                    # that a `scheduler_cls` whose constructor raises fails it, named, and the workers stop.
                    core = EngineCore(engine_config, model_config, executor, block_manager, connector)
            except BaseException:
                await executor.shutdown()
                raise
            task_status.started(core)


def kv_cache_layout(specs: list[Any]) -> KVCacheLayout:
    """The KV cache layout from every rank's `kv_cache_spec` (tensor-parallel ranks name the same layers,
    pipeline stages their own); a layer two ranks give different windows is a model bug, named."""
    windows: dict[int, int | None] = {}
    for rank, spec in enumerate(specs):
        for index, window in spec or ():
            if index in windows and windows[index] != window:
                raise StartupError(f"attention layer {index} has sliding window {window} on rank {rank} but "
                                   f"{windows[index]} on another: every rank must build the same model")
            windows[index] = window
    return build_layout(windows)


@reads("hook:scheduler_cls", "engine core")
def scheduler_class(engine_config: EngineConfig) -> type[SchedulerInterface]:
    """The class `scheduler_cls` names ("pkg.mod:Class": a SchedulerInterface, subclass or not), else
    Scheduler. A custom one is logged once with what async scheduling asks of it."""
    if not engine_config.scheduler_cls:
        return Scheduler
    from asyncengine.plugin_runtime.config_hooks import load_hook

    cls: type[SchedulerInterface] = load_hook("scheduler_cls", engine_config.scheduler_cls)
    if engine_config.async_scheduling and not issubclass(cls, Scheduler):
        # vLLM warns that its scheduler interface is not public when a custom class is used; here the
        # interface is public, and what a class must know is what async scheduling does to its calls.
        logger.warning("scheduler_cls %s does not subclass Scheduler and async scheduling is on: the step loop "
                       "calls its schedule() for the next step while a step runs, before update_from_output() "
                       "folds that step's tokens in, so it must count a request's tokens in flight (as "
                       "Scheduler does) or run with async_scheduling=False", engine_config.scheduler_cls)
    else:
        logger.info("scheduler_cls %s%s", engine_config.scheduler_cls,
                    ": async scheduling on (the step loop's, kept)" if engine_config.async_scheduling else "")
    return cls


def check_budget(engine_config: EngineConfig, model_config: ModelConfig) -> None:
    budget = engine_config.effective_max_num_batched_tokens
    speculative = engine_config.speculative
    if speculative is not None:
        check_against_engine(speculative, tensor_parallel_size=engine_config.tensor_parallel_size,
                             max_model_len=model_config.max_model_len, max_num_batched_tokens=budget)
        if engine_config.pipeline_parallel_size > 1:
            raise ConfigError("speculative_config is not built for pipeline parallelism yet (its stages would "
                              "need the drafts and the accepted counts); use pipeline_parallel_size=1",
                              field="speculative_config")
    if not engine_config.enable_chunked_prefill and budget < model_config.max_model_len:
        raise ConfigError(
            f"without chunked prefill a whole prompt must fit in one step: max_num_batched_tokens "
            f"({budget}) must be at least max_model_len ({model_config.max_model_len})",
            field="max_num_batched_tokens",
        )
