"""The `additional_config` keys' table (docs/reference.md, additional_config): key -> the validator of
whoever claimed it. A general plugin calls `AdditionalConfigRegistry.claim("key", validator)`; the
validator is called with the value and raises to refuse it.

The check that every key is claimed and accepted runs in the frontend's config-hooks phase
(asyncengine/plugin_runtime/additional_config.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncengine.interfaces.registry import Registry


def _accept_any(value: Any) -> None:
    """The default validator: any value."""


class _AdditionalConfigRegistry(Registry[Callable[[Any], Any]]):
    def __init__(self) -> None:
        # Validators are objects, checked when claimed: a callable (Callable, as a runtime check).
        super().__init__("additional_config", "additional_config key", Callable, instances=True,
                         expected="callable: validator(value), raising to refuse a value")

    def claim(self, key: str, validator: Callable[[Any], Any] | None = None, *, override: bool = False) -> None:
        """Claim `additional_config[key]`; `validator(value)` raises to refuse a value (None: any value)."""
        self.register(key, validator or _accept_any, override=override)


AdditionalConfigRegistry = _AdditionalConfigRegistry()

__all__ = ["AdditionalConfigRegistry"]
