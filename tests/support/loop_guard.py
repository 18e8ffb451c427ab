"""A guard that fails a test when something blocks the event loop too long (trio instrumentation).

Every task step (the code a task runs between two awaits) is timed; one longer than the threshold is
recorded with the task's name. The `anyio_backend` fixture installs a fresh guard for each trio test,
and the test fails at teardown if the guard saw a blocking step. The threshold comes from
ASYNCENGINE_TEST_LOOP_BLOCK_MS (default 250 ms: generous for a shared 2-core machine, far below a
model step, which must never run on the loop).
"""

from __future__ import annotations

import os
import time

import trio

DEFAULT_THRESHOLD = float(os.environ.get("ASYNCENGINE_TEST_LOOP_BLOCK_MS", "250")) / 1000


class LoopBlockingGuard(trio.abc.Instrument):
    def __init__(self, threshold: float = DEFAULT_THRESHOLD) -> None:
        self.threshold = threshold
        self.violations: list[tuple[str, float]] = []
        self._step_started = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._step_started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        elapsed = time.perf_counter() - self._step_started
        if elapsed > self.threshold:
            self.violations.append((task.name, elapsed))

    def report(self) -> str:
        return "; ".join(f"{name} ran {elapsed * 1000:.0f} ms without yielding" for name, elapsed in self.violations)
