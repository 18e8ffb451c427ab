"""Executor: the interface of what runs the workers for the engine core (`distributed_executor_backend`,
docs/reference.md, the executor backend: "uni", "mp", or "pkg.mod:Class" naming a subclass).

The built-ins (UniExecutor: the worker on a thread of the engine-core process; MultiprocExecutor: one
process per rank) are in asyncengine/engine_core/executor.py, and a plugin usually subclasses one of
them. The engine core builds it as `cls(engine_config, model_config, platform)`, runs `serve` as a task
of its own, submits steps in order and calls worker methods by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import anyio

from asyncengine.errors import EngineDeadError

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

    from asyncengine.config.engine import EngineConfig
    from asyncengine.config.model import ModelConfig
    from asyncengine.interfaces.platform import Platform


class Executor(ABC):
    # Where its workers run (asyncengine/plugin_runtime/placement.py): "mp", a process per rank, unless the
    # executor runs the worker on a thread of the engine core's process ("uni": UniExecutor and its subclasses).
    worker_placement: ClassVar[str] = "mp"
    # Whether the executor takes a step's grammar masks after the step (asyncengine/structured_output/
    # deferred.py, vLLM's split step): `submit_step(scheduler_output, grammar=mask)`, then
    # `deliver_masks(mask, bitmask)` once they are known; constrained requests then keep async
    # scheduling's overlap. False: `submit_step` is called with the step alone, and constrained requests
    # sit out while a constrained token is in flight.
    supports_deferred_grammar: bool = False

    # What the methods take and give, by the names of the types above the floor (not imported here):
    # `trace` a StartupTrace (asyncengine.plugin_runtime.records), `scheduler_output` a SchedulerOutput
    # (asyncengine.wire.worker), the step's reply a Reply (asyncengine.runtime.reply).

    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, platform: type[Platform]) -> None:
        self.engine_config = engine_config
        self.model_config = model_config
        self.platform = platform
        self.world_size = engine_config.world_size  # tensor_parallel_size x pipeline_parallel_size ranks
        self.failure: EngineDeadError | None = None

    @abstractmethod
    async def serve(self, trace: Any, manifest: Any = None, *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The task that owns the workers: bring them up (devices initialized; worker processes'
        start-up records added to `trace`), call `task_status.started()`, and return once `shutdown()`
        has stopped them, stopping them itself if cancelled first."""

    @abstractmethod
    async def submit_step(self, scheduler_output: Any) -> Any:
        """Queue one step; the reply's value is rank 0's ModelRunnerOutput. An executor that sets
        `supports_deferred_grammar` also takes `grammar=` (a DeferredMask) for its worker's execute_model."""

    async def deliver_masks(self, mask: Any, bitmask: Any) -> None:
        """Hand the masks (a GrammarBitmask, or None) of a step submitted with `grammar=mask` to its
        workers, once the step before it is folded in. Only called when `supports_deferred_grammar`; the
        default sets the DeferredMask that an in-process worker waits on."""
        mask.set(bitmask)

    @abstractmethod
    async def call(self, method: str, /, *args: Any, **kwargs: Any) -> list[Any]:
        """Run worker method `method(*args, **kwargs)` on every rank, in order with the steps; each rank's
        result. The arguments are msgspec-encodable (they cross to worker processes as a WorkerCall)."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the workers (and their processes); idempotent."""

    def _die(self, error: EngineDeadError) -> None:
        if self.failure is None:
            self.failure = error


__all__ = ["Executor"]
