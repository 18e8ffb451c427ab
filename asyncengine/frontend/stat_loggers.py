"""Calling stat-logger plugins with the signatures they declare (ours, or vLLM's).

The interface, StatLoggerBase, is in the floor (asyncengine.interfaces.stat_logger, whose docstring
says when the engine calls what).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from asyncengine.interfaces.stat_logger import INIT_EXTRAS as _INIT_EXTRAS
from asyncengine.interfaces.stat_logger import RECORD_EXTRAS as _RECORD_EXTRAS
from asyncengine.interfaces.stat_logger import declared_extras as _declared

if TYPE_CHECKING:
    from asyncengine.config.engine import EngineConfig


def record_extras(stat_logger: Any) -> dict[str, Any]:
    """The vLLM keyword arguments this logger's `record` declares, with their value here."""
    names = _declared(type(stat_logger).record, tuple(_RECORD_EXTRAS))
    return {name: _RECORD_EXTRAS[name] for name in names}


def call_record(stat_logger: Any, scheduler_stats: Any, iteration_stats: Any) -> Any:
    """`stat_logger.record(...)` with what its signature asks for (ours, or vLLM's)."""
    return stat_logger.record(scheduler_stats, iteration_stats, **record_extras(stat_logger))


def build_stat_logger(cls: type[Any], config: EngineConfig) -> Any:
    """`cls(config)`, giving `engine_index` / `engine_idx` (vLLM's) by keyword when `__init__` names one."""
    names = _declared(cls.__init__, tuple(_INIT_EXTRAS))
    return cls(config, **{name: _INIT_EXTRAS[name] for name in names[:1]})


async def engine_initialized(stat_logger: Any) -> None:
    """Call `log_engine_initialized()` (sync or async) once at start-up."""
    method = getattr(stat_logger, "log_engine_initialized", None)
    if method is None:
        return
    result = method()
    if inspect.isawaitable(result):
        await result


__all__ = ["build_stat_logger", "call_record", "engine_initialized", "record_extras"]
