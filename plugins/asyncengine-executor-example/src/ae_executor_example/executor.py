"""CountingExecutor: asyncengine's multiprocess executor (one worker process per tensor-parallel rank),
counting the steps it submits. Built by the engine core, in its process (EXTENSION_POINTS.md C7).

With AE_PLUGIN_RECORD naming a file it appends JSON lines {"plugin", "event", "pid", "role", ...}:
"built" (with the options it read from additional_config["ae_example_executor"]) and, at shutdown,
"shut down" with the number of steps it submitted.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from asyncengine.plugins_api import MultiprocExecutor, current_process_role

__all__ = ["CountingExecutor"]

RECORD_ENV = "AE_PLUGIN_RECORD"


def _record(event: str, **fields: Any) -> None:
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = {"plugin": "ae_executor_example", "event": event, "pid": os.getpid(), "role": current_process_role(),
            "time": time.time(), **fields}
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(line) + "\n")


class CountingExecutor(MultiprocExecutor):
    def __init__(self, engine_config: Any, model_config: Any, platform: Any) -> None:
        super().__init__(engine_config, model_config, platform)
        # The key was validated in the frontend (the plugin's claim); here it is only read.
        self.options = dict((engine_config.additional_config or {}).get("ae_example_executor", {}))
        self.steps_submitted = 0
        _record("built", options=self.options, world_size=self.world_size)

    async def submit_step(self, scheduler_output: Any) -> Any:
        self.steps_submitted += 1
        return await super().submit_step(scheduler_output)

    async def shutdown(self) -> None:
        if self.options.get("record_steps", True):
            _record("shut down", steps=self.steps_submitted, label=self.options.get("label"))
        await super().shutdown()
