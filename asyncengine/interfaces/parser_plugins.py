"""Loading a parser plugin given on the command line (`--tool-parser-plugin`, `--reasoning-parser-plugin`).

The parser tables (registration by decorator, lookup by name) are beside it, in
asyncengine.interfaces.parsers; their `import_tool_parser` / `import_reasoning_parser` (vLLM's names, which
plugins call too) call `import_plugin` here. It needs only the standard library and the floor, so it sits in
the floor with the tables, and nothing has to install it.

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

from asyncengine.errors import StartupError
from asyncengine.interfaces.registry import current_registrant


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


__all__ = ["import_plugin"]
