"""A guard that fails a test when something blocks the event loop too long (trio instrumentation).

Every task step (the code a task runs between two awaits) is timed, less any garbage-collection
pause inside it (a full collection of a test process holding torch and reference models takes
200+ ms and is nobody's blocking call); a step longer than the threshold is recorded with the task's name. The `anyio_backend` fixture installs a fresh guard for each trio test,
and the test fails at teardown if the guard saw a blocking step. The threshold comes from
ASYNCENGINE_TEST_LOOP_BLOCK_MS (default 250 ms: generous for a shared 2-core machine, far below a
model step, which must never run on the loop).
"""

from __future__ import annotations

import gc
import os
import time

import trio

DEFAULT_THRESHOLD = float(os.environ.get("ASYNCENGINE_TEST_LOOP_BLOCK_MS", "250")) / 1000


class LoopBlockingGuard(trio.abc.Instrument):
    def __init__(self, threshold: float = DEFAULT_THRESHOLD) -> None:
        self.threshold = threshold
        self.violations: list[tuple[str, float]] = []
        self._step_started = 0.0
        self._gc_started = 0.0
        self._gc_time = 0.0

    def before_run(self) -> None:
        gc.callbacks.append(self._on_gc)

    def after_run(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_time += time.perf_counter() - self._gc_started

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._step_started = time.perf_counter()
        self._gc_time = 0.0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        elapsed = time.perf_counter() - self._step_started - self._gc_time
        if elapsed > self.threshold:
            self.violations.append((task.name, elapsed))

    def report(self) -> str:
        return "; ".join(f"{name} ran {elapsed * 1000:.0f} ms without yielding" for name, elapsed in self.violations)
