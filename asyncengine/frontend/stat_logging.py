"""StatLogging: how an AsyncEngine feeds its stat loggers without letting one of them stall the streams.

Stat loggers (the stat-logger plugins, and any added with `AsyncEngine.add_stat_logger`) get every
step's scheduler and iteration stats in `record`, and a `log()` call every `stats_log_interval`
seconds; their interface is vLLM's (stat_loggers.py).

Where a logger runs depends on what its `record` is:
- a plain function is called in the output handler, right after the step's outputs were handed to
  their requests and before the handler's next await: such a logger (Prometheus's) has counted a
  step before any consumer wakes up to its outputs. It cannot await, so it cannot wait for
  anything; a slow one blocks the event loop wherever it runs, and no task could change that.
- a coroutine function (`async def record`) may wait, for a network or a disk. It runs in a task
  of its own, which the output handler feeds through a bounded memory stream (RECORD_BUFFER steps)
  without ever waiting: when the logger falls behind and its buffer is full, the step's stats are
  dropped for that logger, counted (`num_dropped`, per logger in `dropped_records()`) and reported
  once per `stats_log_interval` in the log, never per drop. Its task calls `log()` too, on its own
  timer, so `record` and `log` of one logger never overlap.

All these tasks belong to the task of `run`, which the engine starts in its task group: they end
with the engine. A logger that raises is a bug that would leave the metrics silently wrong, so the
engine stops serving with an EngineDeadError naming it (`on_failure`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncengine.config.engine import EngineConfig
from asyncengine.errors import EngineDeadError, StartupError
from asyncengine.frontend.iteration_stats import IterationStats, StatsTracker
from asyncengine.interfaces.stat_logger import StatLoggerBase
from asyncengine.frontend.stat_loggers import build_stat_logger, call_record, engine_initialized
from asyncengine.wire.engine_core import EngineCoreOutputs, SchedulerStats

logger = logging.getLogger(__name__)

# Steps an async logger may fall behind before its stats are dropped: at a step every 10-50 ms, one to
# a few seconds of a logger that waits on something slow.
RECORD_BUFFER = 64

_Record = tuple[SchedulerStats | None, IterationStats]


@dataclass(eq=False)
class _AsyncLogger:
    """A logger with an `async def record`, fed through its own bounded stream."""

    stat_logger: StatLoggerBase
    send: MemoryObjectSendStream[_Record]
    receive: MemoryObjectReceiveStream[_Record]
    num_dropped: int = 0
    dropped_since_report: int = 0


class StatLogging:
    def __init__(self, interval: float, on_failure: Callable[[EngineDeadError], Awaitable[None]],
                 last_scheduler_stats: Callable[[], SchedulerStats | None]) -> None:
        self.interval = interval
        # The requests' per-step figures, fed only while there is a logger: without one, stats cost nothing.
        self.tracker = StatsTracker()
        self._on_failure = on_failure
        self._last_scheduler_stats = last_scheduler_stats
        # Tuples replaced as a whole, so that a step iterates a stable snapshot.
        self._loggers: tuple[StatLoggerBase, ...] = ()
        self._inline: tuple[StatLoggerBase, ...] = ()
        self._async: tuple[_AsyncLogger, ...] = ()
        self._task_group: TaskGroup | None = None
        self._have_loggers = anyio.Event()
        self._stopped = False
        # Inline `record` calls never overlap (a step's and the idle flush's). Taken without a checkpoint
        # when free, so recording a step lets no other task run before a synchronous `record` is done.
        self._inline_lock = anyio.Lock(fast_acquire=True)

    @property
    def loggers(self) -> tuple[StatLoggerBase, ...]:
        return self._loggers

    @property
    def active(self) -> bool:
        """Whether stats are gathered: there is a logger and the engine is alive."""
        return bool(self._loggers) and not self._stopped

    @property
    def num_dropped(self) -> int:
        """Steps' stats dropped in all, summed over the async loggers that fell behind."""
        return sum(entry.num_dropped for entry in self._async)

    def dropped_records(self) -> dict[str, int]:
        """Dropped steps per async logger (`module:qualname` of its class)."""
        return {qualified_name(type(entry.stat_logger)): entry.num_dropped for entry in self._async}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The owner of the async loggers' tasks and of the periodic `log()` of the inline ones."""
        try:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                task_status.started()
                await self._log_periodically()
        finally:
            for entry in self._async:  # also those whose task was cancelled before it began
                entry.send.close()
                entry.receive.close()

    def add(self, stat_logger: StatLoggerBase) -> None:
        """Feed `stat_logger` from the next step on (on the event loop's thread)."""
        if self._task_group is None:
            raise RuntimeError("StatLogging.add before StatLogging.run started")
        if inspect.iscoroutinefunction(stat_logger.record):
            send, receive = anyio.create_memory_object_stream[_Record](RECORD_BUFFER)
            entry = _AsyncLogger(stat_logger, send, receive)
            self._async = (*self._async, entry)
            self._task_group.start_soon(self._serve, entry, name=f"stat logger {qualified_name(type(stat_logger))}")
        else:
            self._inline = (*self._inline, stat_logger)
        self._loggers = (*self._loggers, stat_logger)
        self._have_loggers.set()

    def stop(self) -> None:
        """The engine died: record nothing more."""
        self._stopped = True
        self.tracker.clear()
        for entry in self._async:
            entry.send.close()  # its task sees the end of its stream
        self._have_loggers.set()

    async def record_step(self, message: EngineCoreOutputs, received: float, stopped_in_frontend: list[str]) -> None:
        """One step's stats to every logger; `received`: when its outputs arrived."""
        if not self.active:
            return
        iteration_stats = self.tracker.step(message.outputs, received, stopped_in_frontend=stopped_in_frontend,
                                            admitted=message.admitted_request_ids, step_seconds=message.step_seconds)
        await self._dispatch(message.scheduler_stats, iteration_stats)

    async def _dispatch(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats) -> None:
        for entry in self._async:
            try:
                entry.send.send_nowait((scheduler_stats, iteration_stats))
            except anyio.WouldBlock:
                entry.num_dropped += 1
                entry.dropped_since_report += 1
        if not self._inline:
            return
        async with self._inline_lock:
            for stat_logger in self._inline:
                if self._stopped:
                    return
                try:
                    await _call(call_record, stat_logger, scheduler_stats, iteration_stats)  # ours or vLLM's signature
                except Exception as exc:
                    await self._failed(stat_logger, "record", exc)
                    return

    async def _serve(self, entry: _AsyncLogger) -> None:
        """An async logger's task: its records as they come, and `log()` every interval."""
        next_log = anyio.current_time() + self.interval
        async with entry.receive:
            while not self._stopped:
                item: _Record | None = None
                with anyio.CancelScope(deadline=next_log):
                    try:
                        item = await entry.receive.receive()
                    except anyio.EndOfStream:
                        return
                if self._stopped:
                    return
                method = "log" if item is None else "record"
                try:
                    if item is None:
                        next_log = anyio.current_time() + self.interval
                        await _call(entry.stat_logger.log)
                    else:
                        await _call(call_record, entry.stat_logger, *item)
                except Exception as exc:
                    await self._failed(entry.stat_logger, method, exc)
                    return

    async def _log_periodically(self) -> None:
        """Every interval: report the aborts an idle engine has not reported yet, call each inline
        logger's `log()`, and say which async loggers dropped stats since the last time."""
        await self._have_loggers.wait()
        while not self._stopped:
            await anyio.sleep(self.interval)
            if self._stopped:
                return
            pending = self.tracker.take_pending()
            if pending is not None:
                await self._dispatch(self._last_scheduler_stats(), pending)
            for stat_logger in self._inline:
                if self._stopped:
                    return
                try:
                    await _call(stat_logger.log)
                except Exception as exc:
                    await self._failed(stat_logger, "log", exc)
                    return
            self._report_drops()

    def _report_drops(self) -> None:
        for entry in self._async:
            if entry.dropped_since_report:
                logger.warning(
                    "stat logger %s fell behind: the stats of %d steps were dropped in the last %g s (%d in all); "
                    "its record() takes longer than a step: make it cheaper, or hand the work to a task of its own",
                    qualified_name(type(entry.stat_logger)), entry.dropped_since_report, self.interval,
                    entry.num_dropped,
                )
                entry.dropped_since_report = 0

    async def _failed(self, stat_logger: StatLoggerBase, method: str, exc: Exception) -> None:
        if self._stopped:
            return  # the engine is already dead: the first failure is the one reported
        name = qualified_name(type(stat_logger))
        logger.error("stat logger %s raised in %s()", name, method, exc_info=exc)
        error = EngineDeadError(f"stat logger {name} raised in {method}(): {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        await self._on_failure(error)


async def _call(function: Callable[..., Any], *args: Any) -> None:
    """A logger's method, plain or `async def` (or plain returning an awaitable)."""
    result = function(*args)
    if inspect.isawaitable(result):
        await result


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


async def logger_initialized(stat_logger: StatLoggerBase) -> None:
    """`log_engine_initialized()`, at start-up; what it raises is a StartupError naming the plugin."""
    try:
        await engine_initialized(stat_logger)
    except Exception as exc:  # the plugin's own failure, at start-up: named
        raise StartupError(f"stat logger plugin {qualified_name(type(stat_logger))} raised in "
                           f"log_engine_initialized(): {type(exc).__name__}: {exc}") from exc


def plugin_stat_loggers(classes: list[type], config: EngineConfig) -> list[Any]:
    """One instance of each stat-logger plugin class, built as `cls(config)`."""
    loggers = []
    for cls in classes:
        try:
            loggers.append(build_stat_logger(cls, config))
        except Exception as exc:
            raise StartupError(
                f"stat logger plugin {qualified_name(cls)} raised when constructed: {type(exc).__name__}: {exc}"
            ) from exc
    return loggers
