"""ExampleStatLogger: counts tokens and finished requests, and logs a JSON summary line.

The entry point is the class itself (group `asyncengine.stat_logger_plugins`); the engine builds it as
`ExampleStatLogger(engine_config)` in the frontend, calls `record(scheduler_stats, iteration_stats)`
after every engine step and `log()` every `stats_log_interval` seconds (`--stats-log-interval`).

`log()` writes one JSON line when the counts changed since its previous line: appended to the file
named by the environment variable AE_EXAMPLE_STATS_FILE when it is set, else logged at info level
(logger `ae_stat_logger_example`). With AE_PLUGIN_RECORD naming a file, its first `record` and first
`log` in a process append a JSON line there naming the pid and the process role.
It imports only asyncengine.plugins_api.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from asyncengine.plugins_api import StatLoggerBase, current_process_role

__all__ = ["ExampleStatLogger", "SUMMARY_FILE_ENV"]

SUMMARY_FILE_ENV = "AE_EXAMPLE_STATS_FILE"
logger = logging.getLogger("ae_stat_logger_example")
_recorded: set[str] = set()


def _record_once(what: str) -> None:
    """One line per `what` and process, only when AE_PLUGIN_RECORD is set."""
    path = os.environ.get("AE_PLUGIN_RECORD")
    if not path or what in _recorded:
        return
    _recorded.add(what)
    with open(path, "a", encoding="utf-8") as record:
        record.write(json.dumps({"what": what, "pid": os.getpid(), "role": current_process_role()}) + "\n")


class ExampleStatLogger(StatLoggerBase):
    def __init__(self, engine_config: Any = None) -> None:
        super().__init__(engine_config)
        self.steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished_requests = 0
        self.finished_generation_tokens = 0  # the finished requests' own counts, summed
        self.finish_reasons: dict[str, int] = {}
        self.max_running = 0
        self.summary_path = os.environ.get(SUMMARY_FILE_ENV) or None
        self._last_logged: dict[str, Any] | None = None

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        _record_once("stat logger record")
        self.steps += 1
        if scheduler_stats is not None:
            self.max_running = max(self.max_running, scheduler_stats.num_running_reqs)
        if iteration_stats is None:
            return
        self.prompt_tokens += iteration_stats.num_prompt_tokens
        self.generation_tokens += iteration_stats.num_generation_tokens
        for finished in iteration_stats.finished_requests:
            self.finished_requests += 1
            self.finished_generation_tokens += finished.num_generation_tokens
            self.finish_reasons[finished.finish_reason] = self.finish_reasons.get(finished.finish_reason, 0) + 1

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "finished_requests": self.finished_requests,
            "finished_generation_tokens": self.finished_generation_tokens,
            "finish_reasons": dict(sorted(self.finish_reasons.items())),
            "max_running": self.max_running,
        }

    def log(self) -> None:
        _record_once("stat logger log")
        summary = self.summary()
        if summary == self._last_logged:
            return  # nothing new: an idle server writes nothing
        self._last_logged = summary
        line = json.dumps({"what": "stat logger summary", **summary, "pid": os.getpid(),
                           "role": current_process_role()})
        if self.summary_path:
            with open(self.summary_path, "a", encoding="utf-8") as file:
                file.write(line + "\n")
        else:
            logger.info("%s", line)
