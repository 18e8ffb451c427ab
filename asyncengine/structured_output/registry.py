"""The structured-output backend registry: read in the frontend (a request's backend and its
grammar are checked before it is queued) and in the engine core (which compiles and computes masks)."""

from __future__ import annotations

from typing import Any

from asyncengine.errors import ConfigError, RequestError
from asyncengine.interfaces.registry import reads
from asyncengine.interfaces.structured_output import StructuredOutputBackend, StructuredOutputBackendRegistry

# configured_backend_name (the config's default backend) is a config check: asyncengine/config/structured_outputs.py.


def register_structured_output_backend(name: str, backend: Any, *, override: bool = False) -> None:
    """Register a StructuredOutputBackend subclass (or "pkg.mod:Class") under `name`."""
    StructuredOutputBackendRegistry.register(name, backend, override=override)


def _load(name: str, *, field: str, error: type[RequestError] | type[ConfigError]) -> type:
    """The backend class, through the registry's one lookup; a request naming a backend gets its refusal as
    a RequestError (a 400) naming the request's field, the configuration a ConfigError naming the option."""
    try:
        return StructuredOutputBackendRegistry.load(name)
    except ConfigError as refused:
        raise error(str(refused), field=field) from refused


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
