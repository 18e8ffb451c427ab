"""Config hooks: options that name a class as "package.module:attr" (EXTENSION_POINTS.md, C1-C9).

In the config-hooks phase each process imports and type-checks the hooks its roles read; the
frontend checks all of them before it spawns anything, so a typo fails at once, in the process the
user is looking at, naming the option and the path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from asyncengine.config.engine import EngineConfig
from asyncengine.errors import ConfigError
from asyncengine.plugin_runtime.groups import ENGINE_CORE, FRONTEND, PHASE_CONFIG_HOOKS, WORKER
from asyncengine.plugin_runtime.records import StartupTrace


def _is_model_class(value: Any) -> str | None:
    if not isinstance(value, type):
        return "is not a class"
    if not callable(getattr(value, "load_weights", None)):
        return "has no load_weights method (see asyncengine.models.llama for the model interface)"
    return None


def _hooks(config: EngineConfig) -> Iterator[tuple[str, str, frozenset[str], Callable[[Any], str | None]]]:
    """(option, path, roles that read it, check) for every hook the config names."""
    for architecture, path in config.model_class_overrides.items():
        yield f"model_class_overrides[{architecture!r}]", path, frozenset({FRONTEND, WORKER}), _is_model_class


def check_config_hooks(config: EngineConfig, roles: set[str], trace: StartupTrace) -> None:
    from asyncengine.models.registry import import_by_path

    checks_everything = FRONTEND in roles
    for option, path, readers, check in _hooks(config):
        if not checks_everything and not roles & readers:
            continue
        started = time.time()
        try:
            value = import_by_path(path, what=option)
        except Exception as exc:  # named: the option, the path, the import error
            raise ConfigError(f"{option}: {exc}", field=option.split("[")[0]) from exc
        problem = check(value)
        if problem:
            raise ConfigError(f"{option}: {path} {problem}", field=option.split("[")[0])
        trace.add(PHASE_CONFIG_HOOKS, started=started, plugin=f"{option}={path}")


# Which roles read each hook, for the timeline.
HOOK_READERS = {"model_class_overrides": (FRONTEND, WORKER), "scheduler_cls": (ENGINE_CORE,),
                "worker_cls": (WORKER,), "worker_extension_cls": (WORKER,)}
