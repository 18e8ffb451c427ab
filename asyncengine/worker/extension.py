"""Worker extensions (`worker_extension_cls`, EXTENSION_POINTS.md C3): composed with the worker, never
spliced into its bases.

vLLM adds the extension class to the worker's bases at run time and guards name clashes with a bare
`assert`. Here the worker builds one instance of the extension, `cls(worker)` (the worker is its only
constructor argument), at the end of `init_device`, and `collective_rpc("method", args)` looks the
method up on the worker first, then on the extension. Because the worker wins, an extension method
with a name the worker already has would never run: that is a start-up error naming the attribute
and both classes, found from the classes alone, so the frontend reports it before spawning anything.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from asyncengine.errors import ConfigError, WorkerError
from asyncengine.registries.base import reads

OPTION = "worker_extension_cls"
_MISSING = object()


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


@reads("hook:worker_extension_cls", "worker")
def build_extension(worker: Any, path: str) -> Any:
    """The extension instance for `worker`. The config-hooks phase of this process checked the class
    against the configured worker class (`worker_cls`); checked again here against this worker's own
    class and attributes."""
    from asyncengine.plugin_runtime.config_hooks import load_hook

    extension_cls = load_hook(OPTION, path, config=worker.engine_config)
    problem = extension_problem(extension_cls, type(worker), worker_attributes=vars(worker))
    if problem is not None:
        raise ConfigError(f"{OPTION}: {path} {problem}", field=OPTION)
    return extension_cls(worker)


def rpc_method(worker: Any, name: str) -> Callable[..., Any]:
    """The callable `collective_rpc(name)` runs on this worker: the worker's own method, else its
    extension's. Raises WorkerError saying where it looked."""
    extension = getattr(worker, "extension", None)
    for owner in (worker, extension):
        if owner is None or name.startswith("_"):
            continue
        value = getattr(owner, name, _MISSING)
        if value is not _MISSING:
            if not callable(value):
                raise WorkerError(f"{name!r} is an attribute of {class_path(type(owner))}, not a method")
            return value
    if extension is None:
        raise WorkerError(f"the worker has no method {name!r}")
    raise WorkerError(f"neither the worker nor its extension {class_path(type(extension))} has a method {name!r}")
