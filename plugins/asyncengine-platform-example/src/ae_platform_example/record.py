"""Where this plugin's code ran: with AE_PLUGIN_RECORD naming a file, one JSON line per event,
{"plugin", "event", "pid", "role", ...}, the role as `current_process_role()` says ("frontend",
"engine core", "worker rank N"; in-process, the frontend's process plays every role)."""

from __future__ import annotations

import json
import os
from typing import Any

from asyncengine.plugins_api import current_process_role

RECORD_ENV = "AE_PLUGIN_RECORD"


def record(event: str, **fields: Any) -> None:
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = {"plugin": "ae_platform_example", "event": event, "pid": os.getpid(), "role": current_process_role(),
            **fields}
    # One write of one line in append mode: lines from several processes do not interleave.
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(line) + "\n")
