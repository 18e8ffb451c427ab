"""ExampleWorker: the built-in Worker with what this platform adds, built in each worker process.

The platform sets `worker_cls` to it when the option is "auto" (C2). It adds:
- `init_device` pins torch's intra-op threads to `additional_config["example_threads"]` when given
  (the built-in worker divides the cores between ranks; this makes the count the user's choice);
- `example_report()`, reachable through `collective_rpc("example_report")`: this worker's process,
  role, rank, platform, torch threads, and the attention backend of every layer with its call count;
- a record line ("worker built", "device ready") for each step, with the process id and role.
"""

from __future__ import annotations

import os
from typing import Any

from asyncengine.plugins_api import AttentionBackend, Worker, current_process_role

from ae_platform_example.record import record


class ExampleWorker(Worker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        record("worker built", rank=self.rank, cls=f"{type(self).__module__}:{type(self).__qualname__}",
               platform=self.platform.device_name)

    def init_device(self) -> None:
        import torch

        super().init_device()
        threads = (self.engine_config.additional_config or {}).get("example_threads")
        if threads is not None:
            torch.set_num_threads(threads)
        record("device ready", rank=self.rank, threads=torch.get_num_threads())

    def example_report(self) -> dict:
        import torch

        model = self.model_runner.model if self.model_runner else None
        backends = [module.backend for module in (model.modules() if model is not None else ())
                    if isinstance(getattr(module, "backend", None), AttentionBackend)]
        return {
            "pid": os.getpid(),
            "role": current_process_role(),
            "rank": self.rank,
            "platform": self.platform.device_name,
            "worker_class": f"{type(self).__module__}:{type(self).__qualname__}",
            "threads": torch.get_num_threads(),
            "attention_backends": [f"{type(b).__module__}:{type(b).__qualname__}" for b in backends],
            "attention_calls": [getattr(b, "calls", 0) for b in backends],
        }
