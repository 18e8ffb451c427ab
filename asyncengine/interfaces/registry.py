"""Registry: a named table from keys to implementations, filled by built-ins and plugins.

Registration is idempotent: the same implementation under the same key twice is a no-op; a different
implementation under a taken key is an error naming both owners, unless `override=True`. Every entry
remembers its owner (the plugin whose code registered it, "built-in", or "the calling script"), so a
process that lacks a key another process has can say who registered it there. What the import of an entry
given by path registers (a model module's decorators) is attributed to that entry's owner. No assert anywhere.

`Registry[T](name, what, base)` names the base its implementations must be (a class, or a
runtime-checkable Protocol; `instances=True` for a table of objects rather than classes). An
implementation given as an object is checked when it is registered; one given as a "pkg.mod:Class" path
is imported and checked when first loaded (`load`, the one way an entry is resolved). Each failure names
the key, who registered it, what was given and the base expected (`contract_problem` words it, and the
config hooks use it too).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from asyncengine.errors import ConfigError, ModelLoadError, StartupError
from asyncengine.interfaces.imports import import_by_path

# Who is registering right now: the plugin loader sets it while a plugin's code runs.
current_registrant: contextvars.ContextVar[str] = contextvars.ContextVar("registrant", default="the calling script")
BUILT_IN = "built-in"

T = TypeVar("T")


class RegistrationError(ConfigError):
    """A key is taken by another implementation (pass override=True to replace it), or what was registered
    is not what the registry holds."""


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


def _is_protocol(base: Any) -> bool:
    return bool(getattr(base, "_is_protocol", False))


def contract_problem(value: Any, base: Any, name: str | None = None, *, instances: bool = False) -> str | None:
    """What is wrong with `value` as an implementation of `base`, or None. A class must derive from `base`
    (for a runtime-checkable Protocol: have its methods); with `instances`, an object must be one. `name`
    is how the message calls the base (default: its name)."""
    name = name or getattr(base, "__name__", repr(base))
    if instances:
        if isinstance(value, base):
            return None
        return f"is {value!r}, which does not implement {name}" if _is_protocol(base) else \
            f"is {value!r}, not an instance of {name}"
    if isinstance(value, type) and issubclass(value, base):
        return None
    return f"is {value!r}, which does not implement {name}" if _is_protocol(base) else \
        f"is {value!r}, not a subclass of {name}"


def _model_load_error(message: str, field: str | None) -> StartupError:
    return ModelLoadError(message)


class Registry(Generic[T]):
    """`Registry[T](name, what, base)`: keys -> implementations of `base` (None: any object).

    `name` is how the manifest and errors call the table ("models"), `what` how messages call an entry
    ("model architecture"). `field` is the configuration field that chooses an entry (named by errors);
    `unknown` words a key nobody registered (`{key}`, `{known}` and `{known_repr}` filled in);
    `import_error(message, field)` is the error a lazy entry that fails to import becomes; `expected` words
    what an entry must be, where the base's name does not say it.
    """

    def __init__(self, name: str, what: str, base: Any = None, *, instances: bool = False,
                 field: str | None = None, unknown: str | None = None, expected: str | None = None,
                 import_error: Callable[[str, str | None], StartupError] = _model_load_error) -> None:
        self.name = name
        self.what = what
        self.base = base
        self.instances = instances
        self.field = field
        self.unknown = unknown or f"{what} {{key!r}} is not registered; registered: {{known}}"
        self.import_error = import_error
        self._expected = expected
        self._entries: dict[str, Entry] = {}

    def problem(self, implementation: Any) -> str | None:
        """What is wrong with an (imported) implementation for this table, or None."""
        if self.base is None:
            return None
        return contract_problem(implementation, self.base, instances=self.instances)

    def expected(self) -> str:
        """What `problem` asks for, in words."""
        if self._expected:
            return self._expected
        name = getattr(self.base, "__name__", repr(self.base))
        if _is_protocol(self.base):
            return f"{'an object' if self.instances else 'a class'} implementing {name}"
        return f"an instance of {name}" if self.instances else f"a subclass of {name}"

    # -- filling it ----------------------------------------------------------------------------------------

    def register(self, key: str, implementation: Any, *, override: bool = False, owner: str | None = None) -> None:
        if not isinstance(key, str) or not key:
            raise RegistrationError(f"a {self.what} needs a non-empty string key, got {key!r}")
        owner = owner or current_registrant.get()
        lazy = isinstance(implementation, str) and not self.instances  # a path: checked when loaded
        problem = None if lazy else self.problem(implementation)
        if problem:
            raise RegistrationError(f"{self.what} {key!r}: {owner} registered {implementation!r}, which must be "
                                    f"{self.expected()}" + ("" if self.instances else
                                                            " (or its 'package.module:Class' path)"),
                                    field=self.field)
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

    # -- reading it ----------------------------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key) if isinstance(key, str) else None

    def registered(self, key: str) -> Entry:
        """The entry of a key the caller found registered (through `keys()` or `in`)."""
        entry = self.get(key)
        if entry is None:
            raise KeyError(f"no {self.what} {key!r} is registered in the {self.name!r} registry")
        return entry

    def load(self, key: str) -> T:
        """The implementation registered under `key`, imported when it was given by path and checked against
        the base: the one way an entry is resolved. An unknown key is a ConfigError listing the known ones
        (`unknown`), a failed import `import_error`, a wrong implementation a ConfigError; each names the key
        and, once registered, who registered it."""
        entry = self.get(key)
        if entry is None:
            known = self.keys()
            raise ConfigError(self.unknown.format(key=key, known=", ".join(known),
                                                  known_repr=", ".join(map(repr, known)) or "(none registered)"),
                              field=self.field)
        implementation = entry.implementation
        if isinstance(implementation, str) and not self.instances:
            owner = entry.owner

            def failed(message: str) -> StartupError:
                return self.import_error(f"{message} (registered by {owner})", self.field)

            # What the module registers as it is imported (a model module's MULTIMODAL_REGISTRY decorator, say)
            # is the entry's owner's doing, not whoever happens to be loading it (the calling script).
            token = current_registrant.set(owner)
            try:
                implementation = import_by_path(implementation, what=f"{self.what} {key!r}", error=failed)
            finally:
                current_registrant.reset(token)
        problem = self.problem(implementation)
        if problem:
            raise ConfigError(f"{self.what} {key!r} (registered by {entry.owner}) {problem}; register "
                              f"{self.expected()} under that name", field=self.field)
        return cast(T, implementation)

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
