"""`structured_outputs_config`: its shape, the engine's default structured-output backend, and the
reasoning parser the constraint waits for.

A config check, so in the floor: EngineConfig checks the shape when it is built; the backend's and the
parser's names are checked where their registries are read (the frontend and the engine core).

Keys (vLLM's names): `backend` (default "auto", meaning xgrammar); `reasoning_parser` (a reasoning
parser's name: a constrained request's grammar then starts after the reasoning ends; `serve` sets it
from --reasoning-parser); `enable_in_reasoning` (true: constrain the reasoning too, as without a parser).
"""

from __future__ import annotations

from typing import Any

from asyncengine.errors import ConfigError

DEFAULT_BACKEND = "xgrammar"
KEYS = ("backend", "reasoning_parser", "enable_in_reasoning")


def _checked(structured_outputs_config: dict[str, Any] | None) -> dict[str, Any]:
    config = structured_outputs_config or {}
    unknown = sorted(set(config) - set(KEYS))
    if unknown:
        raise ConfigError(f"structured_outputs_config has unknown keys {unknown}; it takes {', '.join(KEYS)}",
                          field="structured_outputs_config")
    parser = config.get("reasoning_parser")
    if parser is not None and not (isinstance(parser, str) and parser):
        raise ConfigError("structured_outputs_config.reasoning_parser must be a reasoning parser's name",
                          field="structured_outputs_config")
    if not isinstance(config.get("enable_in_reasoning", False), bool):
        raise ConfigError("structured_outputs_config.enable_in_reasoning must be true or false",
                          field="structured_outputs_config")
    return config


def configured_backend_name(structured_outputs_config: dict[str, Any] | None) -> str:
    """The engine's default backend: `structured_outputs_config["backend"]`, else xgrammar ("auto" too).
    Checks the whole config's shape (EngineConfig calls it when built)."""
    name = _checked(structured_outputs_config).get("backend") or "auto"
    if not isinstance(name, str):
        raise ConfigError("structured_outputs_config.backend must be a backend's name",
                          field="structured_outputs_config")
    return DEFAULT_BACKEND if name == "auto" else name


def reasoning_settings(structured_outputs_config: dict[str, Any] | None) -> tuple[str | None, bool]:
    """(the reasoning parser a constraint waits for, or None; whether the reasoning is constrained too)."""
    config = _checked(structured_outputs_config)
    return config.get("reasoning_parser"), bool(config.get("enable_in_reasoning", False))


def with_reasoning_parser(structured_outputs_config: dict[str, Any] | None, name: str | None) -> dict[str, Any] | None:
    """The config with `reasoning_parser` set to the server's --reasoning-parser, unless it names one itself."""
    if name is None or (structured_outputs_config or {}).get("reasoning_parser") is not None:
        return structured_outputs_config
    return {**(structured_outputs_config or {}), "reasoning_parser": name}
