"""What the tool-call and reasoning parser registries share: registration by decorator, lookup by
name, and loading a parser plugin given on the command line (`--tool-parser-plugin`,
`--reasoning-parser-plugin`).

A plugin value is either the path of a .py file or an importable module name; importing it runs its
`register_module` decorators. Every way that can fail is a StartupError naming the option and the
value: a parser the user asked for that silently did not load would only surface later, as an
"unknown parser" error that hides the real cause.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from asyncengine.errors import ConfigError, StartupError
from asyncengine.interfaces.imports import import_by_path
from asyncengine.registries.base import Registry, RegistrationError, current_registrant


class ParserRegistry(Registry):
    """A registry of parser classes, all subclasses of `base`, with vLLM's `register_module` shape.

    `field` is the configuration field that selects a parser (named by lookup errors) and
    `plugin_option` the command-line option that loads plugins (named by plugin errors).
    """

    def __init__(self, name: str, what: str, *, base: type, field: str, option: str, plugin_option: str) -> None:
        super().__init__(name, what)
        self.base = base
        self.field = field
        self.option = option
        self.plugin_option = plugin_option

    def register_module(
        self, name: str | list[str] | type | None = None, force: bool = False, module: type | str | None = None
    ) -> Any:
        """Register a parser class under `name` (a name, a list of aliases, or None for the class name).

        As a decorator: `@Manager.register_module("mine")` (a bare `@Manager.register_module` works
        too). As a call: `Manager.register_module("mine", module=MyParser)`, or lazily with
        `module="package.module:MyParser"`, imported when first looked up. `force=True` replaces a
        parser registered under the same name by someone else; without it that is a RegistrationError
        naming both owners.
        """
        if isinstance(name, type) and module is None:  # the bare decorator: the class came in as `name`
            name, module = None, name
        names = self._names(name)  # checked now, so a bad name fails at the decorator, not at lookup
        if module is not None:
            self._register_all(names, module, force)
            return module

        def decorator(cls: type) -> type:
            self._register_all(names, cls, force)
            return cls

        return decorator

    def resolve(self, name: str) -> type:
        """The parser class registered under `name`; ConfigError (naming the known ones) if none is."""
        entry = self.get(name) if isinstance(name, str) else None
        if entry is None:
            known = ", ".join(repr(key) for key in self.keys()) or "(none registered)"
            raise ConfigError(
                f"unknown {self.what} {name!r}; known: {known}. Pass one of these to {self.option}, or load "
                f"a plugin that registers it with {self.plugin_option}",
                field=self.field,
            )
        implementation = entry.implementation
        if isinstance(implementation, str):
            owner = entry.owner

            def refused(message: str) -> ConfigError:  # a configuration problem, naming who registered it
                return ConfigError(f"{message} (registered by {owner})", field=self.field)

            implementation = import_by_path(implementation, what=f"{self.what} {name!r}", error=refused)
        if not (isinstance(implementation, type) and issubclass(implementation, self.base)):
            raise ConfigError(
                f"{self.what} {name!r} (registered by {entry.owner}) is {implementation!r}, not a subclass of "
                f"{self.base.__name__}; register a {self.base.__name__} subclass under that name",
                field=self.field,
            )
        return implementation

    def import_plugin(self, plugin: str) -> ModuleType:
        """Load a parser plugin (a .py path or a module name); its decorators register its parsers."""
        return import_plugin(plugin, option=self.plugin_option)

    # -- internals ---------------------------------------------------------------------------------

    def _names(self, name: Any) -> list[str] | None:
        if name is None:
            return None  # the class name, known once the class is
        names = [name] if isinstance(name, str) else name
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            raise RegistrationError(
                f"a {self.what} name must be a non-empty string or a non-empty list of them, got {name!r}"
            )
        return names

    def _register_all(self, names: list[str] | None, module: Any, force: bool) -> None:
        if isinstance(module, str):
            if not re.fullmatch(r"[\w.]+:[\w.]+", module):
                raise RegistrationError(
                    f"a {self.what} given by path must look like 'package.module:Class', got {module!r}"
                )
            if names is None:
                names = [module.rpartition(":")[2]]
        elif not (isinstance(module, type) and issubclass(module, self.base)):
            raise RegistrationError(
                f"a {self.what} must be a subclass of {self.base.__name__} (or a 'package.module:Class' "
                f"string), got {module!r}"
            )
        elif names is None:
            names = [module.__name__]
        for key in names:
            try:
                self.register(key, module, override=force)
            except RegistrationError as exc:
                # The base registry's advice names its own keyword; ours is `force`.
                message = str(exc)
                advice = "pass override=True to replace it"
                if message.endswith(advice):
                    message = message[: -len(advice)] + "pass force=True to register_module to replace it"
                raise RegistrationError(message, field=exc.field) from None


def import_plugin(value: Any, *, option: str) -> ModuleType:
    """Import the parser plugin `value` given to `option`: a path to a .py file or a module name.

    Registrations the plugin makes while it is imported are owned by "<option> '<value>'". Importing
    the same file twice returns the module imported the first time (its decorators ran then).
    """
    text = value.strip() if isinstance(value, str) else ""
    if not text:
        raise StartupError(
            f"{option} {value!r}: the value is blank; pass the path of a .py file or an importable module name"
        )
    registrant = f"{option} {value!r}"
    if _looks_like_path(text):
        return _import_file(Path(text).expanduser(), value, option, registrant)
    if not all(part.isidentifier() for part in text.split(".")):
        raise StartupError(
            f"{option} {value!r}: this is neither a path to a .py file nor a module name "
            "(dotted Python identifiers); pass one of those"
        )
    return _run_import(lambda: importlib.import_module(text), value, option, registrant, module_name=None)


def _looks_like_path(text: str) -> bool:
    # Decided by shape, not by existence: a missing file must say "no such file", and a package
    # directory that happens to sit in the working directory is still imported by its module name.
    separators = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return text.endswith(".py") or any(sep in text for sep in separators) or text.startswith("~")


def _import_file(path: Path, value: str, option: str, registrant: str) -> ModuleType:
    if not path.exists():
        raise StartupError(
            f"{option} {value!r}: no such file ({path.absolute()}); pass the path of an existing .py file "
            "or an importable module name"
        )
    if not path.is_file():
        raise StartupError(f"{option} {value!r}: {path.absolute()} is not a file; pass the path of a .py file")
    resolved = path.resolve()
    # A name of its own per file, so two plugins both called parser.py do not replace each other in
    # sys.modules, while the same file given twice maps to the same module.
    stem = re.sub(r"\W", "_", resolved.stem)
    module_name = f"_asyncengine_parser_plugin_{stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:12]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise StartupError(
            f"{option} {value!r}: Python cannot load {resolved} as a module; pass the path of a .py file"
        )
    module = importlib.util.module_from_spec(spec)
    loader = spec.loader

    def load() -> ModuleType:
        # In sys.modules before it runs, as a normal import would be: dataclasses, pickling and
        # relative lookups inside the plugin resolve their module by name.
        sys.modules[module_name] = module
        loader.exec_module(module)
        return module

    return _run_import(load, value, option, registrant, module_name=module_name)


def _run_import(
    load: Callable[[], ModuleType], value: str, option: str, registrant: str, *, module_name: str | None
) -> ModuleType:
    token = current_registrant.set(registrant)
    try:
        return load()
    except (Exception, SystemExit) as exc:  # SystemExit too: a plugin must not end the server quietly
        if module_name is not None:
            sys.modules.pop(module_name, None)  # a half-run module would look loaded the next time
        raise StartupError(
            f"{option} {value!r}: importing it failed with {type(exc).__name__}: {exc}; fix the plugin "
            "(or install what it imports) or drop the option"
        ) from exc
    finally:
        current_registrant.reset(token)
