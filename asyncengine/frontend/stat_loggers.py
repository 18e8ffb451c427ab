"""StatLoggerBase: the interface of stat-logger plugins (entry-point group asyncengine.stat_logger_plugins).

Read in the frontend. The engine builds each plugin class once, calls `log_engine_initialized()` once
the engine has started, `record` after every step with the scheduler's stats and that step's
iteration stats, and `log` periodically; any of them may be a coroutine function.

vLLM's signatures work as they are: `__init__(vllm_config, engine_index=0)` (the config is ours, with
vLLM-shaped views) and `record(scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0)`:
the engine passes `mm_cache_stats=None` (no multimodal cache here) and `engine_idx=0` (one engine)
by keyword to a `record` that declares them, with or without defaults.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any


class StatLoggerBase:
    def __init__(self, engine_config: Any = None, engine_index: int = 0) -> None:
        self.engine_config = engine_config
        self.engine_index = engine_index

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        raise NotImplementedError

    def log(self) -> None:
        """Called periodically; the default logs nothing."""

    def log_engine_initialized(self) -> None:
        """Called once, when the engine has started; the default does nothing."""


# The keyword arguments vLLM passes that mean one fixed thing here.
_RECORD_EXTRAS = {"mm_cache_stats": None, "engine_idx": 0}
_INIT_EXTRAS = {"engine_index": 0, "engine_idx": 0}


@lru_cache(maxsize=None)
def _declared(function: Any, extras: tuple[str, ...]) -> tuple[str, ...]:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature: pass only the positional arguments
        return ()
    return tuple(name for name in extras if name in parameters)


def record_extras(stat_logger: Any) -> dict[str, Any]:
    """The vLLM keyword arguments this logger's `record` declares, with their value here."""
    names = _declared(type(stat_logger).record, tuple(_RECORD_EXTRAS))
    return {name: _RECORD_EXTRAS[name] for name in names}


def call_record(stat_logger: Any, scheduler_stats: Any, iteration_stats: Any) -> Any:
    """`stat_logger.record(...)` with what its signature asks for (ours, or vLLM's)."""
    return stat_logger.record(scheduler_stats, iteration_stats, **record_extras(stat_logger))


def build_stat_logger(cls: type, config: Any) -> Any:
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
