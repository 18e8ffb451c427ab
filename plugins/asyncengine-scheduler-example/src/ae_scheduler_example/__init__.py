"""An example `--scheduler-cls`: asyncengine's Scheduler, recording where it runs and what it schedules.

    asyncengine generate "Hello" --scheduler-cls ae_scheduler_example:RecordingScheduler
    LLM(model, scheduler_cls="ae_scheduler_example:RecordingScheduler")

The engine core builds it instead of `Scheduler`, with the same keyword arguments. It changes no
scheduling decision (outputs are the same as with the built-in scheduler); it only observes, so it
shows the two promises of this hook: the class runs in the engine-core process, and async scheduling
(scheduling step N+1 while step N executes) is kept, because it belongs to the engine's step loop,
not to the scheduler.

With the environment variable AE_PLUGIN_RECORD naming a file, it appends one JSON line when it is
built and one at its first scheduled step: {"plugin", "event", "pid", "role", ...}.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from asyncengine.plugins_api import Scheduler, current_process_role

__all__ = ["RecordingScheduler", "record"]

RECORD_ENV = "AE_PLUGIN_RECORD"


def record(event: str, **fields: Any) -> dict[str, Any]:
    """Append one JSON line to $AE_PLUGIN_RECORD (if set): where this code runs, and `fields`."""
    line = {"plugin": "ae_scheduler_example", "event": event, "pid": os.getpid(),
            "role": current_process_role(), "time": time.time(), **fields}
    path = os.environ.get(RECORD_ENV)
    if path:
        # One write of one line in append mode: lines from several processes do not interleave.
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps(line) + "\n")
    return line


class RecordingScheduler(Scheduler):
    """`Scheduler` plus counters: steps scheduled, and tokens scheduled in them."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_schedule_calls = 0
        self.num_scheduled_tokens = 0
        record("init", cls=f"{type(self).__module__}:{type(self).__qualname__}",
               max_num_seqs=self.max_num_seqs, num_blocks=self.block_manager.num_blocks)

    def schedule(self):
        output = super().schedule()
        self.num_schedule_calls += 1
        self.num_scheduled_tokens += output.total_num_scheduled_tokens
        if self.num_schedule_calls == 1:
            record("first schedule", num_scheduled_tokens=output.total_num_scheduled_tokens)
        return output
