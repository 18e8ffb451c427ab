"""Worker extensions (`worker_extension_cls`, docs/reference.md): composed with the worker, never
spliced into its bases.

vLLM adds the extension class to the worker's bases at run time and guards name clashes with a bare
`assert`. Here the worker builds one instance of the extension, `cls(worker)` (the worker is its only
constructor argument), at the end of `init_device`, and `collective_rpc("method", args)` looks the
method up on the worker first, then on the extension. Because the worker wins, an extension method
with a name the worker already has would never run: that is a start-up error naming the attribute
and both classes, found from the classes alone, so the frontend reports it before spawning anything.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from asyncengine.errors import ConfigError, WorkerError
# The clash check is the config-hook check of worker_extension_cls (the frontend runs it before any worker exists).
from asyncengine.plugin_runtime.config_hooks import class_path, extension_problem
from asyncengine.interfaces.plugin_code import is_plugin_code, plugin_hook
from asyncengine.interfaces.registry import reads

OPTION = "worker_extension_cls"
_MISSING = object()
# The engine core's start-up calls: on a plugin's worker class, a failure names the class, its distribution and
# the call (steps keep their own naming: the engine's death names the culprit, errors.raising_code).
STARTUP_CALLS = ("init_device", "load_model", "determine_num_blocks", "initialize_kv_cache")


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
            if owner is worker and name in STARTUP_CALLS and is_plugin_code(worker):
                return _named(worker, name, value)
            return value
    if extension is None:
        raise WorkerError(f"the worker has no method {name!r}")
    raise WorkerError(f"neither the worker nor its extension {class_path(type(extension))} has a method {name!r}")


def _named(worker: Any, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with plugin_hook(worker, name):
            return method(*args, **kwargs)

    return call
