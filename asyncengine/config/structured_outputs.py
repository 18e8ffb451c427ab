"""`structured_outputs_config`: its shape, and the engine's default structured-output backend.

A config check, so in the floor: EngineConfig checks the shape when it is built; the backend's name is
checked where the registry is read (the frontend and the engine core).
"""

from __future__ import annotations

from typing import Any

from asyncengine.errors import ConfigError

DEFAULT_BACKEND = "xgrammar"


def configured_backend_name(structured_outputs_config: dict[str, Any] | None) -> str:
    """The engine's default backend: `structured_outputs_config["backend"]`, else xgrammar ("auto" too)."""
    config = structured_outputs_config or {}
    unknown = sorted(set(config) - {"backend"})
    if unknown:
        raise ConfigError(f"structured_outputs_config has unknown keys {unknown}; it takes 'backend'",
                          field="structured_outputs_config")
    name = config.get("backend") or "auto"
    if not isinstance(name, str):
        raise ConfigError("structured_outputs_config.backend must be a backend's name",
                          field="structured_outputs_config")
    return DEFAULT_BACKEND if name == "auto" else name
