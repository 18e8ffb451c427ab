"""Naming plugin code that raised: its distribution, the hook and the process.

Every call the engine makes into code a plugin supplies (a platform's hooks, a worker class's methods, a
model loader's, an IO processor's) goes through `plugin_hook(owner, hook)`: an exception from inside becomes
a `PluginCodeError` whose message reads "plugin code pace_vllm.platform.PacePlatform (distribution pace-vllm
1.3.0): its hook check_and_update_config raised ValueError: ... in the frontend (pid 4242)". Our own error
types (a ConfigError a platform raises on purpose, a RequestError) keep their type, with the same naming.

The distribution is found from the owner's top-level module (importlib.metadata's map of installed packages),
so a class installed from PyPI, from a local folder on PYTHONPATH with its dist-info, or built into
asyncengine is each named as what it is.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from typing import Any

from asyncengine.errors import AsyncEngineError, StartupError


class PluginCodeError(StartupError):
    """An exception raised from a plugin's code, named (see the module's docstring). `original` is the
    plugin's exception (also the `__cause__`), `hook` the method, `owner` the plugin's class, `process` where."""

    names_its_process = True  # the message names the process: an enclosing start-up phase passes it on

    def __init__(self, message: str, *, hook: str | None = None, owner: str | None = None,
                 process: str | None = None, original: BaseException | None = None) -> None:
        super().__init__(message)
        self.hook = hook
        self.owner = owner
        self.process = process
        self.original = original


@functools.cache
def _distributions_of_packages() -> dict[str, list[str]]:
    return dict(metadata.packages_distributions())


def distribution_of(obj: Any) -> str | None:
    """'NAME VERSION' of the installed distribution that holds `obj`'s module (a class, a function, an
    instance); None when none does (a module on PYTHONPATH without metadata, a script's class)."""
    module = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", None)
    if not isinstance(module, str):
        return None
    top = module.partition(".")[0]
    names = _distributions_of_packages().get(top)
    if not names:
        _distributions_of_packages.cache_clear()  # installed since the first look (a test's target folder)
        names = _distributions_of_packages().get(top)
    if not names:
        return None
    try:
        return f"{names[0]} {metadata.version(names[0])}"
    except metadata.PackageNotFoundError:
        return names[0]


def describe_owner(obj: Any) -> str:
    """'pkg.mod.Class (distribution NAME VERSION)' for a class, or an instance's class."""
    cls = obj if isinstance(obj, type) else type(obj)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__module__.partition(".")[0] == "asyncengine":
        return f"{name} (built into asyncengine)"
    distribution = distribution_of(cls)
    return f"{name} (distribution {distribution})" if distribution else f"{name} (no installed distribution)"


# Where this process's role is read from: the start-up records install theirs (plugin_runtime/records.py)
# when imported, which every engine start does before it calls plugin code.
_role_source: list[Callable[[], str | None]] = [lambda: None]


def set_role_source(source: Callable[[], str | None]) -> None:
    _role_source[0] = source


def current_process() -> str:
    """'the worker rank 0 (pid 4242)': this process's role (once an engine started here) and pid."""
    role = _role_source[0]() or "process"
    return f"the {role} (pid {os.getpid()})"


def name_plugin_failure(exc: BaseException, owner: Any, hook: str) -> Exception:
    """`exc`, raised by `owner`'s `hook`, as an error naming the plugin, the hook and this process."""
    process = current_process()
    who = describe_owner(owner)
    detail = str(exc) if isinstance(exc, AsyncEngineError) else f"{type(exc).__name__}: {exc}"
    message = f"plugin code {who}: its hook {hook} raised {detail} (in {process})"
    if isinstance(exc, AsyncEngineError) and not isinstance(exc, PluginCodeError):
        try:
            named: Exception = type(exc)(message)
        except TypeError:  # an error type whose constructor takes more: ours, generic, with the original kept
            named = PluginCodeError(message, hook=hook, owner=who, process=process, original=exc)
        else:
            if getattr(exc, "field", None) is not None:
                named.field = exc.field  # type: ignore[attr-defined]
            named.names_its_process = True  # type: ignore[attr-defined]
            named.plugin_hook = hook  # type: ignore[attr-defined]
            named.plugin_owner = who  # type: ignore[attr-defined]
        return named
    return PluginCodeError(message, hook=hook, owner=who, process=process, original=exc)


@contextmanager
def plugin_hook(owner: Any, hook: str) -> Iterator[None]:
    """Run a call into `owner`'s (a plugin class's, or its instance's) `hook`; what it raises comes out
    named. An error already named by an inner call passes unchanged, and so does one from asyncengine's own
    classes (the built-in platforms and workers name their failures themselves)."""
    try:
        yield
    except PluginCodeError:
        raise
    except Exception as exc:  # the plugin's own failure: named, with the original as the cause
        if getattr(exc, "plugin_hook", None) or not is_plugin_code(owner):
            raise
        raise name_plugin_failure(exc, owner, hook) from exc


def is_plugin_code(obj: Any) -> bool:
    """Whether `obj` (a class or an instance) comes from outside asyncengine."""
    cls = obj if isinstance(obj, type) else type(obj)
    return cls.__module__.partition(".")[0] != "asyncengine"


__all__ = ["PluginCodeError", "current_process", "describe_owner", "distribution_of", "is_plugin_code",
           "name_plugin_failure", "plugin_hook"]
