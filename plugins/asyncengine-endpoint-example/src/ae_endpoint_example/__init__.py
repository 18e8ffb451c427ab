"""GET /example/stats: what a background task saw by polling the engine's scheduler.

`make_endpoint()` is the entry point (group `asyncengine.endpoint_plugins`, opt-in: name
`ae_example_stats_endpoint` in `--plugins`). The server calls `attach(app)` to add the route, and runs
`serve(engine_client, task_status)` in its task group for as long as it serves: every
`poll_interval` seconds (0.2) it asks `await engine_client.get_scheduler_stats()` and keeps the
counts: the most requests seen running and waiting at once, the latest ones, and how many polls.

With AE_PLUGIN_RECORD naming a file, each step (attach, the background task's start, the first
request to the route) appends one JSON line there per process, naming the pid and the process role.
It imports only asyncengine.plugins_api (and anyio, which the server runs on).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import anyio

from asyncengine.plugins_api import EndpointPlugin, current_process_role

__all__ = ["ROUTE", "SchedulerWatch", "StatsEndpoint", "make_endpoint"]

ROUTE = "/example/stats"
_recorded: set[str] = set()


def _record_once(what: str, **extra: Any) -> None:
    """One line per `what` and process, only when AE_PLUGIN_RECORD is set."""
    path = os.environ.get("AE_PLUGIN_RECORD")
    if not path or what in _recorded:
        return
    _recorded.add(what)
    line = {"what": what, "pid": os.getpid(), "role": current_process_role(), **extra}
    with open(path, "a", encoding="utf-8") as record:
        record.write(json.dumps(line) + "\n")


class SchedulerWatch:
    """The counts gathered from the scheduler's stats, poll after poll."""

    def __init__(self) -> None:
        self.polls = 0
        self.max_running = 0
        self.max_waiting = 0
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.busy_polls = 0  # polls that saw at least one request running or waiting
        self.errors = 0
        self.last_error: str | None = None
        self.started_at: float | None = None

    def update(self, scheduler_stats: Any) -> None:
        self.polls += 1
        self.running = scheduler_stats.num_running_reqs
        self.waiting = scheduler_stats.num_waiting_reqs
        self.kv_cache_usage = scheduler_stats.kv_cache_usage
        self.max_running = max(self.max_running, self.running)
        self.max_waiting = max(self.max_waiting, self.waiting)
        if self.running or self.waiting:
            self.busy_polls += 1

    def failed(self, error: Exception) -> None:
        self.errors += 1
        self.last_error = f"{type(error).__name__}: {error}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "polling": self.started_at is not None,
            "polls": self.polls,
            "busy_polls": self.busy_polls,
            "max_running": self.max_running,
            "max_waiting": self.max_waiting,
            "running": self.running,
            "waiting": self.waiting,
            "kv_cache_usage": self.kv_cache_usage,
            "seconds_polling": 0.0 if self.started_at is None else round(time.monotonic() - self.started_at, 3),
            "errors": self.errors,
            "last_error": self.last_error,
            "pid": os.getpid(),
        }


class StatsEndpoint(EndpointPlugin):
    name = "example-stats"
    poll_interval = 0.2  # seconds

    def __init__(self) -> None:
        self.watch = SchedulerWatch()

    def attach(self, app: Any) -> None:
        _record_once("endpoint attach", route=ROUTE)

        @app.get(ROUTE)
        async def example_stats() -> dict[str, Any]:
            _record_once("endpoint route", route=ROUTE)
            return self.watch.as_dict()

    async def serve(self, engine_client: Any, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        _record_once("endpoint background task")
        self.watch.started_at = time.monotonic()
        task_status.started()
        while True:  # until the server's task group is cancelled, at shutdown
            try:
                self.watch.update(await engine_client.get_scheduler_stats())
            except Exception as error:  # the engine died or is stopping: say so, never take the server down
                self.watch.failed(error)
            await anyio.sleep(self.poll_interval)


def make_endpoint() -> StatsEndpoint:
    """The entry point: a new plugin instance (one per server)."""
    return StatsEndpoint()
