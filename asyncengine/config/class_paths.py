"""Class paths and class objects in options (the config hooks, platform answers).

A path is written "pkg.mod:Class" (ours) or "pkg.mod.Class" (vLLM's); both are accepted wherever a
path is taken. An option that names a class may also be given the class itself, as vLLM's tests do
(`scheduler_cls=MyScheduler`): the config keeps a path, because it crosses processes as a msgpack
frame, and the class reaches another process by importing that path there.

A class that no other process can import (defined in `__main__`, which is a different script in a
child, or inside a function) still works in-process: it is remembered here under its path, and the
config-hooks phase refuses it, saying why, when a process other than the frontend's would read it.
"""

from __future__ import annotations

import sys
from typing import Any

# The options that name a class (their list items, for logits_processors).
CLASS_OPTIONS = ("scheduler_cls", "worker_cls", "worker_extension_cls", "distributed_executor_backend",
                 "logits_processors")

# path -> class, for classes given as objects that are reachable in this process only.
_IN_PROCESS_ONLY: dict[str, type] = {}


def is_class_path(value: Any) -> bool:
    """True for "pkg.mod:Class" and "pkg.mod.Class" (a module part and an attribute part, both non-empty)."""
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
        return False
    module, colon, attr = value.partition(":")
    if colon:
        return bool(module) and bool(attr)
    module, dot, attr = value.rpartition(".")
    return bool(dot) and bool(module) and bool(attr)


def split_class_path(path: str) -> list[tuple[str, str]]:
    """The (module, attribute) splits to try for `path`, most likely first. "a.b:C.D" has one; a dotted
    "a.b.C" may be module "a.b" with attribute "C", or module "a" with attribute "b.C"."""
    module, colon, attr = path.partition(":")
    if colon:
        return [(module, attr)]
    parts = path.split(".")
    return [(".".join(parts[:i]), ".".join(parts[i:])) for i in range(len(parts) - 1, 0, -1)]


def in_process_only_reason(path: str) -> str | None:
    """Why the class remembered under `path` cannot reach another process, or None if it can."""
    cls = _IN_PROCESS_ONLY.get(path)
    if cls is None:
        return None
    if cls.__module__ == "__main__":
        return (f"{cls.__qualname__} is defined in __main__ (the script that was run), which another process "
                f"cannot import: it is a different script there; move the class into an importable module")
    return (f"{cls.__qualname__} is defined inside a function, so no other process can import it by "
            f"{cls.__module__}:{cls.__qualname__}; define it at the top level of an importable module")


def remembered_class(path: str) -> type | None:
    """The class object given for `path` in this process, when it is not importable elsewhere."""
    return _IN_PROCESS_ONLY.get(path)


def class_to_path(value: Any) -> Any:
    """A class object as its "module:qualname" path (remembered when only this process can reach it);
    anything else unchanged."""
    if not isinstance(value, type):
        return value
    path = f"{value.__module__}:{value.__qualname__}"
    if value.__module__ == "__main__" or "<locals>" in value.__qualname__ or not _importable_as(path, value):
        _IN_PROCESS_ONLY[path] = value
    return path


def _importable_as(path: str, cls: type) -> bool:
    module_name, _, attr = path.partition(":")
    target: Any = sys.modules.get(module_name)  # the class exists, so its module was imported already
    for part in attr.split("."):
        target = getattr(target, part, None)
    return target is cls


def classes_to_paths(values: dict[str, Any]) -> dict[str, Any]:
    """`values` (keyword options) with every class given to a class option replaced by its path."""
    converted = dict(values)
    for option in CLASS_OPTIONS:
        value = converted.get(option)
        if isinstance(value, (list, tuple)):
            converted[option] = [class_to_path(item) for item in value]
        elif isinstance(value, type):
            converted[option] = class_to_path(value)
    return converted


def struct_classes_to_paths(config: Any) -> None:
    """In place, on an EngineConfig built directly (`EngineConfig(scheduler_cls=MyScheduler)`): every
    class given to a class option becomes its path, as `classes_to_paths` does for keyword options."""
    for option, value in classes_to_paths({o: getattr(config, o) for o in CLASS_OPTIONS}).items():
        if value is not getattr(config, option):
            setattr(config, option, value)
