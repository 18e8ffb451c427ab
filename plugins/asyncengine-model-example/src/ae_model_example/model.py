"""ExampleLlamaForCausalLM: asyncengine's Llama under an architecture name of its own.

It computes exactly what the built-in `LlamaForCausalLM` does (same layers, same weight names, same
tensor-parallel sharding), so a checkpoint whose config.json says
`"architectures": ["ExampleLlamaForCausalLM"]` gives the built-in model's greedy outputs. What it
adds: with the environment variable AE_PLUGIN_RECORD naming a file, each construction appends one
JSON line there, {"plugin", "event": "built", "pid", "role", "class"}, with the role as
`asyncengine.plugins_api.current_process_role()` says ("worker rank N" in a worker process;
"frontend" in-process, where the frontend's process plays every role).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from asyncengine.plugins_api import LlamaForCausalLM, current_process_role

__all__ = ["ExampleLlamaForCausalLM", "RECORD_ENV"]

RECORD_ENV = "AE_PLUGIN_RECORD"


def _record(event: str, **fields: Any) -> None:
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = {"plugin": "ae_model_example", "event": event, "pid": os.getpid(), "role": current_process_role(),
            "time": time.time(), **fields}
    # One write of one line in append mode: lines from several processes do not interleave.
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(line) + "\n")


class ExampleLlamaForCausalLM(LlamaForCausalLM):
    """Built by the worker with the built-in model's constructor arguments (config, dtype, max_position)."""

    def __init__(self, config: Any, *, dtype: Any, max_position: int) -> None:
        super().__init__(config, dtype=dtype, max_position=max_position)
        _record("built", cls=f"{type(self).__module__}:{type(self).__qualname__}")
