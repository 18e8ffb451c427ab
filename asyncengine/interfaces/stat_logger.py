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

# The keyword arguments vLLM passes that mean one fixed thing here: given to a `record` or `__init__` that
# declares them (the frontend calls stat loggers so; the plugin runtime checks their signatures at start-up).
RECORD_EXTRAS: dict[str, Any] = {"mm_cache_stats": None, "engine_idx": 0}
INIT_EXTRAS: dict[str, Any] = {"engine_index": 0, "engine_idx": 0}


@lru_cache(maxsize=None)
def declared_extras(function: Any, extras: tuple[str, ...]) -> tuple[str, ...]:
    """Which of `extras` the signature of `function` declares, in the order of `extras`."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature: pass only the positional arguments
        return ()
    return tuple(name for name in extras if name in parameters)


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


__all__ = ["INIT_EXTRAS", "RECORD_EXTRAS", "StatLoggerBase", "declared_extras"]
