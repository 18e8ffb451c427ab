"""The structured-output backend registry: read in the frontend (a request's backend and its
grammar are checked before it is queued) and in the engine core (which compiles and computes masks)."""

from __future__ import annotations

from typing import Any

from asyncengine.errors import ConfigError, ModelLoadError, RequestError
from asyncengine.interfaces.imports import import_by_path
from asyncengine.interfaces.registry import reads
from asyncengine.interfaces.structured_output import StructuredOutputBackend, StructuredOutputBackendRegistry

# configured_backend_name (the config's default backend) is a config check: asyncengine/config/structured_outputs.py.


def register_structured_output_backend(name: str, backend: Any, *, override: bool = False) -> None:
    """Register a StructuredOutputBackend subclass (or "pkg.mod:Class") under `name`."""
    StructuredOutputBackendRegistry.register(name, backend, override=override)


def _load(name: str, *, field: str, error: type[RequestError] | type[ConfigError]) -> type:
    entry = StructuredOutputBackendRegistry.get(name)
    if entry is None:
        raise error(f"unknown structured-output backend {name!r} (registered: "
                    f"{', '.join(StructuredOutputBackendRegistry.keys())}); register one with "
                    "register_structured_output_backend", field=field)
    implementation = entry.implementation
    if isinstance(implementation, str):
        implementation = import_by_path(implementation, what=f"structured-output backend {name!r}",
                                        error=ModelLoadError)
    if not (isinstance(implementation, type) and issubclass(implementation, StructuredOutputBackend)):
        raise error(f"structured-output backend {name!r} (registered by {entry.owner}) is "
                    f"{implementation!r}, not a StructuredOutputBackend subclass", field=field)
    return implementation


@reads("structured_output_backends", "frontend")
def backend_class_for_request(name: str, *, per_request: bool) -> type:
    """The class to validate a request's grammar with, in the frontend."""
    if per_request:
        return _load(name, field="structured_outputs.backend", error=RequestError)
    return _load(name, field="structured_outputs_config", error=ConfigError)


@reads("structured_output_backends", "engine core")
def backend_class(name: str) -> type:
    """The class the engine core builds to compile grammars and compute masks."""
    return _load(name, field="structured_outputs_config", error=ConfigError)
