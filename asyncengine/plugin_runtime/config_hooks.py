"""Config hooks: options that name a class as "package.module:attr" (docs/reference.md, config hooks).

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

import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from asyncengine.config.engine import BUILTIN_WORKER, EngineConfig
from asyncengine.errors import ConfigError, ModelLoadError
from asyncengine.interfaces.executor import Executor
from asyncengine.interfaces.imports import import_by_path
from asyncengine.interfaces.kv_connector import KVConnectorBase
from asyncengine.interfaces.logits import LogitsProcessor
from asyncengine.interfaces.models import ModelClass
from asyncengine.interfaces.registry import contract_problem
from asyncengine.interfaces.roles import ENGINE_CORE, FRONTEND, WORKER
from asyncengine.plugin_runtime.groups import PHASE_CONFIG_HOOKS
from asyncengine.plugin_runtime.records import StartupTrace


# The built-in a scheduler_cls must subclass, named by its path as config names the built-in worker
# (BUILTIN_WORKER): the plugin runtime sits below the roles that define them, and imports one only to check
# a class that replaces it (the check needs the concrete class: a scheduler keeps the built-in's step loop).
BUILTIN_SCHEDULER = "asyncengine.engine_core.scheduler:Scheduler"


def _builtin(path: str) -> type:
    return import_by_path(path, what="the built-in class", error=ModelLoadError)


def _is_model_class(value: Any) -> str | None:
    problem = contract_problem(value, ModelClass)
    return problem and f"{problem}: a class with load_weights (see asyncengine.models.llama for the model interface)"


def _is_scheduler_class(value: Any) -> str | None:
    if not isinstance(value, type):
        return f"is {value!r}, not a class; name a subclass of asyncengine.plugins_api.Scheduler"
    if not issubclass(value, _builtin(BUILTIN_SCHEDULER)):
        return ("is not a subclass of asyncengine.engine_core.scheduler:Scheduler; subclass "
                "asyncengine.plugins_api.Scheduler (the engine core builds it with Scheduler's keyword "
                "arguments and keeps async scheduling, which belongs to its step loop)")
    return None


def _is_worker_class(value: Any) -> str | None:
    if not isinstance(value, type):
        return f"is {value!r}, not a class; name a subclass of asyncengine.plugins_api.Worker"
    if not issubclass(value, _builtin(BUILTIN_WORKER)):
        return ("is not a subclass of asyncengine.worker.worker:Worker; subclass asyncengine.plugins_api.Worker "
                "(the worker interface: each worker builds it with Worker's arguments and the engine core calls "
                "its methods by name)")
    return None


def _configured_worker_class(config: EngineConfig | None) -> type:
    """The class `worker_cls` names ("auto" and None: the built-in Worker)."""
    path = config.worker_cls if config is not None else "auto"
    if path in ("auto", BUILTIN_WORKER):
        return _builtin(BUILTIN_WORKER)
    return load_hook("worker_cls", path)  # a bad one is reported naming worker_cls


def _is_worker_extension(value: Any, config: EngineConfig | None = None) -> str | None:
    # Against the configured worker class: the names collective_rpc finds on the worker first.
    return extension_problem(value, _configured_worker_class(config))


def _is_executor_class(value: Any) -> str | None:
    if not isinstance(value, type) or not issubclass(value, Executor):
        return (f"is {value!r}, not an Executor: subclass asyncengine.plugins_api.Executor (or UniExecutor / "
                "MultiprocExecutor)")
    return None


def _subclass_of(base: type) -> Callable[[Any], str | None]:
    """The check of a hook that names a subclass of `base`: the registries' (contract_problem), the base
    named as plugins import it."""
    def check(value: Any) -> str | None:
        return contract_problem(value, base, f"asyncengine.plugins_api.{base.__name__}")

    return check


# -- worker_extension_cls: composed with the worker (asyncengine/worker/extension.py), checked from the classes

def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def public_methods(cls: type) -> set[str]:
    """The names collective_rpc could reach on instances of `cls`: public callables, inherited included."""
    return {name for name in dir(cls) if not name.startswith("_") and callable(getattr(cls, name, None))}


def public_names(cls: type) -> set[str]:
    """Every public name instances of `cls` have: class attributes, and instance attributes declared as
    annotations in the class body (the Worker declares its own, so a clash with `rank` is found
    without building a worker)."""
    names = {name for name in dir(cls) if not name.startswith("_")}
    for klass in cls.__mro__:
        names.update(name for name in vars(klass).get("__annotations__", {}) if not name.startswith("_"))
    return names


def extension_problem(extension_cls: Any, worker_cls: type, *, worker_attributes: Any = ()) -> str | None:
    """What is wrong with `extension_cls` as an extension of `worker_cls`, or None. The class alone
    suffices (so every process, the frontend included, checks before any worker exists); a built
    worker adds the names of the attributes it set on itself (`worker_attributes`)."""
    if not isinstance(extension_cls, type):
        return f"is {extension_cls!r}, not a class; name a class that takes the worker: Class(worker)"
    worker_names = public_names(worker_cls) | {name for name in worker_attributes if not name.startswith("_")}
    clashes = sorted(public_methods(extension_cls) & worker_names)
    if clashes:
        name = clashes[0]
        return (f"defines public method {name!r}, which the worker class {class_path(worker_cls)} already has: "
                f"collective_rpc({name!r}) finds the worker's first, so {class_path(extension_cls)}.{name} would "
                f"never run; rename it in the extension"
                + (f" (other clashing names: {', '.join(map(repr, clashes[1:]))})" if clashes[1:] else ""))
    try:
        inspect.signature(extension_cls).bind(object())
    except TypeError as exc:
        return f"cannot be built as {extension_cls.__qualname__}(worker): {exc}; its constructor takes the worker"
    except ValueError:  # no signature to inspect (a class implemented in C): building it will tell
        pass
    return None



@dataclass(frozen=True)
class Hook:
    readers: tuple[str, ...]  # the roles that read it (docs/reference.md, "reads it")
    check: Callable[..., str | None]  # what is wrong with the imported value, or None
    checks: str  # what the check is, in words, for the timeline
    with_config: bool = False  # check(value, config): the check depends on other options


HOOKS: dict[str, Hook] = {
    "model_class_overrides": Hook((FRONTEND, WORKER), _is_model_class, "a model class with load_weights"),
    "scheduler_cls": Hook((ENGINE_CORE,), _is_scheduler_class, "a Scheduler subclass"),
    "worker_cls": Hook((WORKER,), _is_worker_class, "a Worker subclass"),
    "worker_extension_cls": Hook((WORKER,), _is_worker_extension,
                                 "a class built as Class(worker), no public method clashing with the worker's",
                                 with_config=True),
    "logits_processors": Hook((FRONTEND, WORKER), _subclass_of(LogitsProcessor), "a LogitsProcessor subclass"),
    "distributed_executor_backend": Hook((ENGINE_CORE,), _is_executor_class, "an Executor subclass"),
    # kv_transfer_config's kv_connector_module_path: the class kv_connector in that module.
    "kv_connector_module_path": Hook((ENGINE_CORE, WORKER), _subclass_of(KVConnectorBase),
                                     "a KVConnectorBase subclass"),
}

# Which roles read each hook (docs/reference.md's "reads it" column).
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
    if config.executor_backend not in ("uni", "mp", "ray"):  # "pkg.mod:Executor": an executor class
        yield "distributed_executor_backend", "distributed_executor_backend", config.executor_backend
    kv_transfer = config.kv_transfer
    if kv_transfer is not None and kv_transfer.kv_connector_module_path:
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
    field = option.split("[")[0]
    try:
        value = import_by_path(path, what=option, error=ModelLoadError)
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
