"""An executor of one's own (config hook `distributed_executor_backend`, EXTENSION_POINTS.md C7),
configured through a key of `additional_config` that this plugin claims (C9).

    [project.entry-points."asyncengine.general_plugins"]
    ae_executor_example = "ae_executor_example:register"

`register()` claims the key "ae_example_executor" with a validator; the frontend checks every key of
`additional_config` in its config-hooks phase, so a misspelt option fails start-up there, naming the key and
this plugin, before any process is spawned. The executor class is named by the configuration:
`distributed_executor_backend="ae_executor_example.executor:CountingExecutor"`; the engine core builds it.

This module imports only asyncengine.plugins_api, as every plugin should.
"""

from __future__ import annotations

from typing import Any

from asyncengine.plugins_api import AdditionalConfigRegistry

__all__ = ["CONFIG_KEY", "EXECUTOR_PATH", "register", "validate_options"]

CONFIG_KEY = "ae_example_executor"
EXECUTOR_PATH = "ae_executor_example.executor:CountingExecutor"
OPTIONS = {"label": str, "record_steps": bool}


def validate_options(value: Any) -> None:
    """{"label": str, "record_steps": bool}, both optional; anything else is refused, saying why."""
    if not isinstance(value, dict):
        raise ValueError(f"expected a dict with keys {sorted(OPTIONS)}, got {type(value).__name__}")
    unknown = sorted(set(value) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; known: {sorted(OPTIONS)}")
    for name, kind in OPTIONS.items():
        if name in value and not isinstance(value[name], kind):
            raise ValueError(f"option {name!r} must be a {kind.__name__}, got {value[name]!r}")


def register() -> None:
    AdditionalConfigRegistry.claim(CONFIG_KEY, validate_options)
