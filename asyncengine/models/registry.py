"""ModelRegistry (in the floor, asyncengine.interfaces.models; imported here): architecture name (config.json's `architectures`) -> model class.

Built-in models register here in code, so the engine works from a source tree with no installed
metadata. A class may be given lazily as "package.module:Class"; it is imported when first needed,
and an import error is raised with its traceback (never remembered as "unsupported").
"""

from __future__ import annotations

from typing import Any

from asyncengine.errors import ModelLoadError
from asyncengine.interfaces.imports import import_by_path as _import_by_path
from asyncengine.interfaces.models import ModelRegistry, _ModelRegistry


def import_by_path(path: str, *, what: str) -> Any:
    """asyncengine.interfaces.imports.import_by_path raising ModelLoadError (this module's callers expect
    it); new callers use that one with their own error."""
    return _import_by_path(path, what=what, error=ModelLoadError)


__all__ = ["ModelRegistry", "import_by_path"]
