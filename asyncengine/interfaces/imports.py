"""`import_by_path`: the one way asyncengine imports a class named as "package.module:attr".

Config hooks, registry entries given as lazy paths, platform answers and the server's parser
plugins all go through it. It raises the error its caller chooses (`error=`), so each caller names
its own culprit: a model class fails as a ModelLoadError, a config hook as a ConfigError naming the
option. Without a choice it raises ClassPathImportError.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from asyncengine.config.class_paths import is_class_path, remembered_class, split_class_path


class ClassPathImportError(ImportError):
    """A "package.module:attr" path could not be imported (its message names what and where)."""


def import_by_path(path: str, *, what: str,
                   error: Callable[[str], BaseException] = ClassPathImportError) -> Any:
    """Import "package.module:attr" (or vLLM's "package.module.attr"), raising `error(message)`, whose
    message names `what` and the path. A class given as an object in this process is found under its
    path first. An exception the imported module itself raises propagates unchanged."""
    if not is_class_path(path):
        raise error(f"{what}: {path!r} is not of the form 'package.module:Class' (or 'package.module.Class')")
    remembered = remembered_class(path)
    if remembered is not None:
        return remembered
    splits = split_class_path(path)
    not_found: BaseException | None = None  # the first split's "no such module", reported if no split works
    for index, (module_name, attr) in enumerate(splits):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            failure = error(f"{what}: importing {module_name!r} failed: {exc}")
            failure.__cause__ = exc
            if exc.name == module_name and index + 1 < len(splits):
                not_found = not_found or failure
                continue  # dotted "a.b.C": no module "a.b", so maybe module "a" with attribute "b.C"
            raise not_found or failure
        except ImportError as exc:
            raise error(f"{what}: importing {module_name!r} failed: {exc}") from exc
        target: Any = module
        for part in attr.split("."):
            if not hasattr(target, part):
                raise not_found or error(f"{what}: module {module_name!r} has no attribute {attr!r}")
            target = getattr(target, part)
        return target
    raise AssertionError("unreachable: split_class_path gives at least one split for a class path")


__all__ = ["ClassPathImportError", "import_by_path"]
