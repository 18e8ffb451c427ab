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

from typing import Any

from ae_model_example._record import RECORD_ENV, record
from asyncengine.plugins_api import LlamaForCausalLM

__all__ = ["ExampleLlamaForCausalLM", "RECORD_ENV"]


class ExampleLlamaForCausalLM(LlamaForCausalLM):
    """Built by the worker with the built-in model's constructor arguments (config, dtype, max_position)."""

    def __init__(self, config: Any, *, dtype: Any, max_position: int) -> None:
        super().__init__(config, dtype=dtype, max_position=max_position)
        record("built", cls=f"{type(self).__module__}:{type(self).__qualname__}")
