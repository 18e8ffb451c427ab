"""The `additional_config` keys' table (docs/reference.md, additional_config): key -> the validator of
whoever claimed it. A general plugin calls `AdditionalConfigRegistry.claim("key", validator)`; the
validator is called with the value and raises to refuse it.

The check that every key is claimed and accepted runs in the frontend's config-hooks phase
(asyncengine/plugin_runtime/additional_config.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncengine.interfaces.registry import Registry, RegistrationError


def _accept_any(value: Any) -> None:
    """The default validator: any value."""


class _AdditionalConfigRegistry(Registry):
    def __init__(self) -> None:
        super().__init__("additional_config", "additional_config key")

    def claim(self, key: str, validator: Callable[[Any], Any] | None = None, *, override: bool = False) -> None:
        """Claim `additional_config[key]`; `validator(value)` raises to refuse a value (None: any value)."""
        if validator is not None and not callable(validator):
            raise RegistrationError(f"additional_config key {key!r}: the validator must be callable, got {validator!r}")
        self.register(key, validator or _accept_any, override=override)


AdditionalConfigRegistry = _AdditionalConfigRegistry()

__all__ = ["AdditionalConfigRegistry"]
