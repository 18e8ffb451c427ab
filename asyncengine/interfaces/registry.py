"""Registry: a named table from keys to implementations, filled by built-ins and plugins.

Registration is idempotent: the same implementation under the same key twice is a no-op; a different
implementation under a taken key is an error naming both owners, unless `override=True`. Every entry
remembers its owner (the plugin whose code registered it, "built-in", or "the calling script"), so a
process that lacks a key another process has can say who registered it there. No assert anywhere.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

from asyncengine.errors import ConfigError

# Who is registering right now: the plugin loader sets it while a plugin's code runs.
current_registrant: contextvars.ContextVar[str] = contextvars.ContextVar("registrant", default="the calling script")
BUILT_IN = "built-in"


class RegistrationError(ConfigError):
    """A key is taken by another implementation (pass override=True to replace it)."""


@dataclass(frozen=True)
class Entry:
    implementation: Any  # an object, or "package.module:attr" to import when first needed
    owner: str


def describe(implementation: Any) -> str:
    if isinstance(implementation, str):
        return implementation
    module = getattr(implementation, "__module__", None)
    name = getattr(implementation, "__qualname__", None) or type(implementation).__qualname__
    return f"{module}:{name}" if module else name


class Registry:
    def __init__(self, name: str, what: str) -> None:
        self.name = name  # "models", as the manifest and errors call it
        self.what = what  # "model architecture", for messages
        self._entries: dict[str, Entry] = {}

    def register(self, key: str, implementation: Any, *, override: bool = False, owner: str | None = None) -> None:
        if not isinstance(key, str) or not key:
            raise RegistrationError(f"a {self.what} needs a non-empty string key, got {key!r}")
        owner = owner or current_registrant.get()
        current = self._entries.get(key)
        if current is not None and not override:
            if describe(current.implementation) == describe(implementation):
                return  # the same implementation again (perhaps once as a path, once as the object)
            raise RegistrationError(
                f"{self.what} {key!r} is already registered to {describe(current.implementation)} "
                f"(by {current.owner}); {owner} tried to register {describe(implementation)}: "
                "pass override=True to replace it"
            )
        self._entries[key] = Entry(implementation, owner)

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def registered(self, key: str) -> Entry:
        """The entry of a key the caller found registered (through `keys()` or `in`)."""
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"no {self.what} {key!r} is registered in the {self.name!r} registry")
        return entry

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        return sorted(self._entries)

    def owners(self) -> dict[str, str]:
        """Key -> owner, for the manifest."""
        return {key: entry.owner for key, entry in sorted(self._entries.items())}


# -- where registries are read ----------------------------------------------------------------------------
# `asyncengine plugins map` shows, per process, every registry read there and the code that reads it.
# The code says so itself: the function that looks a registry up carries `@reads(registry, role)`, and a
# test checks that every lookup in the package sits in a function marked so. The map is built from these
# marks, so it cannot drift from the code.


@dataclass(frozen=True)
class ReadSite:
    registry: str  # the registry's name ("models")
    role: str  # the process role that runs this code ("frontend", "engine core", "worker")
    function: Any

    @property
    def location(self) -> str:
        """`package/module.py:line` of the reading function."""
        import inspect
        from pathlib import Path

        function = inspect.unwrap(self.function)
        source = Path(inspect.getsourcefile(function) or "?")
        parts = source.parts
        start = max(i for i, part in enumerate(parts) if part == "asyncengine") if "asyncengine" in parts else 0
        return f"{'/'.join(parts[start:])}:{inspect.getsourcelines(function)[1]}"


_READ_SITES: list[ReadSite] = []


def reads(registry: str, role: str):
    """Mark a function as reading `registry` in processes of `role` (see `plugins map`)."""

    def mark(function: Any) -> Any:
        # Module level only: a decorator run by each call of an enclosing function would add a site per call,
        # and `plugins map` would then depend on what ran before it.
        if "<locals>" in getattr(function, "__qualname__", ""):
            raise TypeError(f"reads({registry!r}, {role!r}) marks {function.__qualname__}, a nested function: mark "
                            "the module-level function that encloses it")
        _READ_SITES.append(ReadSite(registry, role, function))
        return function

    return mark


def recorded_read_sites() -> list[ReadSite]:
    return list(_READ_SITES)
