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

# The bounds' defaults (EngineConfig's structured_outputs_* fields; docs/structured_outputs.md, "Bounds"). The
# cache's is vLLM's for xgrammar's cache (VLLM_XGRAMMAR_CACHE_MB, 512). A compile past 30 s is far beyond any
# schema measured in use (a 2,000-property schema compiles in about 1 s on 2 cores). The source sizes: a JSON
# schema of 512 KiB holds over 10,000 properties; 64 KiB of regex alternation (8,000 words) compiles in under
# a second, where 1.4 MB took minutes; grammars and choice lists get 128 KiB.
DEFAULT_CACHE_BYTES = 512 * 1024**2
DEFAULT_COMPILE_TIMEOUT = 30.0
DEFAULT_MAX_SCHEMA_BYTES = 512 * 1024
DEFAULT_MAX_REGEX_BYTES = 64 * 1024
DEFAULT_MAX_GRAMMAR_BYTES = 128 * 1024
SIZE_LIMIT_FIELDS = ("structured_outputs_cache_bytes", "structured_outputs_max_schema_bytes",
                     "structured_outputs_max_regex_bytes", "structured_outputs_max_grammar_bytes")


def check_structured_outputs_bounds(config: Any) -> None:
    """EngineConfig's structured_outputs_* bounds: sizes at least 1 byte, a positive time limit."""
    for name in SIZE_LIMIT_FIELDS:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a number of bytes, at least 1; got {value!r}", field=name)
    timeout = config.structured_outputs_compile_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ConfigError(f"structured_outputs_compile_timeout must be a positive number of seconds; got {timeout!r}",
                          field="structured_outputs_compile_timeout")


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
