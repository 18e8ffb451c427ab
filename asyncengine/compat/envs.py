"""vLLM's `vllm.envs`: the environment flags a plugin branches on, answered with the value they have here.

A module, as vLLM's is, so that `import vllm.envs as envs`, `from vllm import envs` and `from vllm.envs import
VLLM_LOGGING_LEVEL` each port to it (asyncengine/porting/table.py). `VLLM_USE_V1` is true (this engine's
design is vLLM's v1); `VLLM_PLUGINS` reads ASYNCENGINE_PLUGINS; the others in ANSWERED read the variable of
the same name with vLLM's default, where the value means the same here (logging, the host's address) or is
only informative. Any other name is an AttributeError saying so, rather than a guess.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _plugins() -> list[str] | None:
    value = os.environ.get("ASYNCENGINE_PLUGINS")
    return None if value is None else [name.strip() for name in value.split(",")]


def _port() -> int | None:
    value = os.environ.get("VLLM_PORT")
    return int(value) if value else None


# name -> how it is read, each call (vLLM's envs read the environment at each access too).
ANSWERED: dict[str, Callable[[], Any]] = {
    "VLLM_USE_V1": lambda: True,
    "VLLM_ENABLE_V1_MULTIPROCESSING": lambda: os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0",
    "VLLM_PLUGINS": _plugins,
    "VLLM_LOGGING_LEVEL": lambda: os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper(),
    "VLLM_CONFIGURE_LOGGING": lambda: int(os.environ.get("VLLM_CONFIGURE_LOGGING", "1")),
    "VLLM_LOGGING_PREFIX": lambda: os.environ.get("VLLM_LOGGING_PREFIX", ""),
    "VLLM_HOST_IP": lambda: os.environ.get("VLLM_HOST_IP", ""),
    "VLLM_PORT": _port,
    "VLLM_CPU_KVCACHE_SPACE": lambda: int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "0")),
    "VLLM_CPU_OMP_THREADS_BIND": lambda: os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
}


def __getattr__(name: str) -> Any:
    reader = ANSWERED.get(name)
    if reader is None:
        raise AttributeError(f"envs.{name}: asyncengine has no counterpart of vLLM's {name} (docs/porting.md, "
                             "'Environment variables'); read os.environ, or use an option")
    return reader()


def __dir__() -> list[str]:
    return sorted(ANSWERED)
