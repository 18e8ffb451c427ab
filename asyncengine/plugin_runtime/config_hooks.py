"""Config hooks: options that name a class as "package.module:attr" (EXTENSION_POINTS.md, C1-C9).

A hook may also be given as "package.module.attr" (vLLM's form) or as the class itself
(asyncengine/config/class_paths.py keeps its path).

In the config-hooks phase each process imports and type-checks the hooks its roles read; the
frontend checks all of them before it spawns anything, so a typo fails at once, in the process the
user is looking at, naming the option, the path and what is wrong with it.

HOOKS is the one table of which hook is checked how and read where: the phase below, the engine
core and the worker (through `load_hook`), and the `plugins timeline` plan (through `hooks_checked`)
all use it, so the plan lists exactly what each process checks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from asyncengine.config.engine import BUILTIN_WORKER, EngineConfig
from asyncengine.errors import ConfigError, ModelLoadError
from asyncengine.plugin_runtime.groups import ENGINE_CORE, FRONTEND, PHASE_CONFIG_HOOKS, WORKER
from asyncengine.plugin_runtime.records import StartupTrace


def _is_model_class(value: Any) -> str | None:
    if not isinstance(value, type):
        return "is not a class"
    if not callable(getattr(value, "load_weights", None)):
        return "has no load_weights method (see asyncengine.models.llama for the model interface)"
    return None


def _is_scheduler_class(value: Any) -> str | None:
    from asyncengine.engine_core.scheduler import Scheduler

    if not isinstance(value, type):
        return f"is {value!r}, not a class; name a subclass of asyncengine.plugins_api.Scheduler"
    if not issubclass(value, Scheduler):
        return ("is not a subclass of asyncengine.engine_core.scheduler:Scheduler; subclass "
                "asyncengine.plugins_api.Scheduler (the engine core builds it with Scheduler's keyword "
                "arguments and keeps async scheduling, which belongs to its step loop)")
    return None


def _is_worker_class(value: Any) -> str | None:
    from asyncengine.worker.worker import Worker

    if not isinstance(value, type):
        return f"is {value!r}, not a class; name a subclass of asyncengine.plugins_api.Worker"
    if not issubclass(value, Worker):
        return ("is not a subclass of asyncengine.worker.worker:Worker; subclass asyncengine.plugins_api.Worker "
                "(the worker interface: each worker builds it with Worker's arguments and the engine core calls "
                "its methods by name)")
    return None


def _configured_worker_class(config: EngineConfig | None) -> type:
    """The class `worker_cls` names ("auto" and None: the built-in Worker)."""
    from asyncengine.worker.worker import Worker

    path = config.worker_cls if config is not None else "auto"
    if path in ("auto", BUILTIN_WORKER):
        return Worker
    return load_hook("worker_cls", path)  # a bad one is reported naming worker_cls


def _is_worker_extension(value: Any, config: EngineConfig | None = None) -> str | None:
    from asyncengine.worker.extension import extension_problem

    # Against the configured worker class: the names collective_rpc finds on the worker first.
    return extension_problem(value, _configured_worker_class(config))


def _is_logits_processor(value: Any) -> str | None:
    from asyncengine.worker.logits_processors import LogitsProcessor

    if not isinstance(value, type) or not issubclass(value, LogitsProcessor):
        return f"is {value!r}, not a subclass of asyncengine.plugins_api.LogitsProcessor"
    return None


def _is_executor_class(value: Any) -> str | None:
    from asyncengine.engine_core.executor import Executor

    if not isinstance(value, type) or not issubclass(value, Executor):
        return (f"is {value!r}, not an Executor: subclass asyncengine.plugins_api.Executor (or UniExecutor / "
                "MultiprocExecutor)")
    return None


def _is_kv_connector(value: Any) -> str | None:
    from asyncengine.kv_transfer.base import KVConnectorBase

    if not isinstance(value, type) or not issubclass(value, KVConnectorBase):
        return f"is {value!r}, not a subclass of asyncengine.plugins_api.KVConnectorBase"
    return None


@dataclass(frozen=True)
class Hook:
    readers: tuple[str, ...]  # the roles that read it (EXTENSION_POINTS.md, "reads it")
    check: Callable[[Any], str | None]  # what is wrong with the imported value, or None
    checks: str  # what the check is, in words, for the timeline
    with_config: bool = False  # check(value, config): the check depends on other options


HOOKS: dict[str, Hook] = {
    "model_class_overrides": Hook((FRONTEND, WORKER), _is_model_class, "a model class with load_weights"),
    "scheduler_cls": Hook((ENGINE_CORE,), _is_scheduler_class, "a Scheduler subclass"),
    "worker_cls": Hook((WORKER,), _is_worker_class, "a Worker subclass"),
    "worker_extension_cls": Hook((WORKER,), _is_worker_extension,
                                 "a class built as Class(worker), no public method clashing with the worker's",
                                 with_config=True),
    "logits_processors": Hook((FRONTEND, WORKER), _is_logits_processor, "a LogitsProcessor subclass"),
    "distributed_executor_backend": Hook((ENGINE_CORE,), _is_executor_class, "an Executor subclass"),
    # kv_transfer_config's kv_connector_module_path (C6): the class kv_connector in that module.
    "kv_connector_module_path": Hook((ENGINE_CORE, WORKER), _is_kv_connector, "a KVConnectorBase subclass"),
}

# Which roles read each hook (EXTENSION_POINTS.md's "reads it" column).
HOOK_READERS = {option: hook.readers for option, hook in HOOKS.items()}


def _hooks(config: EngineConfig) -> Iterator[tuple[str, str, str]]:
    """(option as named in messages, field, path) for every hook the config sets."""
    for architecture, path in config.model_class_overrides.items():
        yield f"model_class_overrides[{architecture!r}]", "model_class_overrides", path
    for field in ("scheduler_cls", "worker_cls", "worker_extension_cls"):
        path = getattr(config, field)
        if path and path not in ("auto", BUILTIN_WORKER):  # None, "" and "auto" all mean "the built-in"
            yield field, field, path
    for index, path in enumerate(config.logits_processors or ()):
        yield f"logits_processors[{index}]", "logits_processors", path
    if config.executor_backend not in ("uni", "mp"):  # "pkg.mod:Executor" (C7)
        yield "distributed_executor_backend", "distributed_executor_backend", config.executor_backend
    kv_transfer = config.kv_transfer
    if kv_transfer is not None and kv_transfer.kv_connector_module_path:  # C6
        yield ("kv_connector_module_path", "kv_connector_module_path",
               f"{kv_transfer.kv_connector_module_path}:{kv_transfer.kv_connector}")


def hooks_checked(config: EngineConfig, roles: set[str]) -> list[tuple[str, str]]:
    """(option, path) of the hooks a process playing `roles` checks: the frontend checks every hook
    (before it spawns anything), the other processes those their roles read."""
    checks_everything = FRONTEND in roles
    return [(option, path) for option, field, path in _hooks(config)
            if checks_everything or roles & set(HOOKS[field].readers)]


def load_hook(option: str, path: str, *, config: EngineConfig | None = None) -> Any:
    """Import `path` and check it for `option`, or raise ConfigError naming the option, the path and
    what is wrong. `config` gives the checks that depend on other options those options
    (`worker_extension_cls` is checked against the configured `worker_cls`)."""
    from asyncengine.models.registry import import_by_path

    field = option.split("[")[0]
    try:
        value = import_by_path(path, what=option)
    except ModelLoadError as exc:  # it names the option and the path already, and says what failed
        raise ConfigError(str(exc), field=field) from exc
    except Exception as exc:  # the module raised while being imported: named, with the error
        raise ConfigError(f"{option}: importing {path!r} raised {type(exc).__name__}: {exc}", field=field) from exc
    hook = HOOKS[field]
    problem = hook.check(value, config) if hook.with_config else hook.check(value)
    if problem:
        raise ConfigError(f"{option}: {path} {problem}", field=field)
    return value


def check_config_hooks(config: EngineConfig, roles: set[str], trace: StartupTrace) -> None:
    """The config-hooks phase's work. It imports user code, so callers run it in a thread."""
    from asyncengine.config.class_paths import in_process_only_reason

    for option, path in hooks_checked(config, roles):
        started = time.time()
        field = option.split("[")[0]
        elsewhere = [role for role in HOOKS[field].readers if role not in roles]
        reason = in_process_only_reason(path)
        if reason and elsewhere:  # given as a class object that only this process can reach
            raise ConfigError(f"{option}: the class given cannot reach the {' and '.join(elsewhere)} process, "
                              f"which reads it: {reason} (or run in one process: in_process=True with the "
                              "'uni' executor)", field=field)
        load_hook(option, path, config=config)
        trace.add(PHASE_CONFIG_HOOKS, started=started, plugin=f"{option}={path}")
