"""An example `--worker-extension-cls`: RPC methods added to every worker, by composition.

    LLM(model, worker_extension_cls="ae_worker_extension_example:RankInfoExtension")
    llm.collective_rpc("describe_rank")   # one answer per tensor-parallel rank

Each worker builds one instance, `RankInfoExtension(worker)`, when it initializes its device (before
the model loads, so the methods read the worker's state when they are called). `collective_rpc`
looks a method up on the worker first, then on the extension; a public method here with a name the
worker has (`describe`, `load_model`, ...) would fail start-up, naming it and both classes.

With the environment variable AE_PLUGIN_RECORD naming a file, it appends one JSON line when it is
built and one per `describe_rank` call: {"plugin", "event", "pid", "role", "rank"}.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from asyncengine.plugins_api import current_process_role

__all__ = ["RankInfoExtension", "record"]

RECORD_ENV = "AE_PLUGIN_RECORD"


def record(event: str, **fields: Any) -> dict[str, Any]:
    """Append one JSON line to $AE_PLUGIN_RECORD (if set): where this code runs, and `fields`."""
    line = {"plugin": "ae_worker_extension_example", "event": event, "pid": os.getpid(),
            "role": current_process_role(), "time": time.time(), **fields}
    path = os.environ.get(RECORD_ENV)
    if path:
        # One write of one line in append mode: lines from several processes do not interleave.
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps(line) + "\n")
    return line


class RankInfoExtension:
    """Adds `describe_rank()` and `num_calls()` to the worker it is given."""

    def __init__(self, worker: Any) -> None:
        # Composition: the worker is held, not inherited from, so nothing here can shadow its methods.
        self._worker = worker
        self._num_calls = 0
        record("init", rank=worker.rank)

    def describe_rank(self) -> dict[str, Any]:
        """This rank, the process it runs in, and the bytes of the model's parameters on this rank."""
        self._num_calls += 1
        worker = self._worker
        runner = worker.model_runner
        model = getattr(runner, "model", None) if runner is not None else None
        parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) if model is not None else 0
        line = record("describe_rank", rank=worker.rank)
        return {"rank": worker.rank, "world_size": worker.world_size, "pid": line["pid"], "role": line["role"],
                "parameter_bytes": parameter_bytes}

    def num_calls(self) -> int:
        """How many times describe_rank ran on this rank (state lives in the extension instance)."""
        return self._num_calls
