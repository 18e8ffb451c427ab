"""Registries that plugins fill, and which process reads each (EXTENSION_POINTS.md, "reads it").

The manifest check compares, in each child process, the registries its role reads with the
frontend's: a key the frontend has and the child lacks fails start-up there, naming it.
"""

from __future__ import annotations

from asyncengine.registries.base import BUILT_IN, Registry, RegistrationError, current_registrant

FRONTEND, ENGINE_CORE, WORKER = "frontend", "engine core", "worker"


def all_registries() -> dict[str, tuple[Registry, frozenset[str]]]:
    """Registry name -> (registry, the roles that read it)."""
    from asyncengine.models.registry import ModelRegistry

    return {
        ModelRegistry.name: (ModelRegistry, frozenset({FRONTEND, WORKER})),
    }


__all__ = ["BUILT_IN", "ENGINE_CORE", "FRONTEND", "WORKER", "Registry", "RegistrationError", "all_registries",
           "current_registrant"]
