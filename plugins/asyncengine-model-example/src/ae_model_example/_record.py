"""Where the plugin's code ran: with AE_PLUGIN_RECORD naming a file, each event appends one JSON line
{"plugin", "event", "pid", "role", "time", ...}, the role as `current_process_role()` says it."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from asyncengine.plugins_api import current_process_role

RECORD_ENV = "AE_PLUGIN_RECORD"


def record(event: str, **fields: Any) -> None:
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = {"plugin": "ae_model_example", "event": event, "pid": os.getpid(), "role": current_process_role(),
            "time": time.time(), **fields}
    # One write of one line in append mode: lines from several processes do not interleave.
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(line) + "\n")
