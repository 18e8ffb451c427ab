"""StatLoggerBase: the interface of stat-logger plugins (entry-point group asyncengine.stat_logger_plugins).

Read in the frontend. The engine calls `record` after every step with the scheduler's stats and that
step's iteration stats, and `log` periodically; either may be a coroutine function.
"""

from __future__ import annotations

from typing import Any


class StatLoggerBase:
    def __init__(self, engine_config: Any = None) -> None:
        self.engine_config = engine_config

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        raise NotImplementedError

    def log(self) -> None:
        """Called periodically; the default logs nothing."""
