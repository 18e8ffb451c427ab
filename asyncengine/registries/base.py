"""The Registry type: moved to asyncengine.interfaces.registry (the floor); imported from there."""

from __future__ import annotations

from asyncengine.interfaces.registry import (
    BUILT_IN,
    Entry,
    ReadSite,
    Registry,
    RegistrationError,
    current_registrant,
    describe,
    reads,
    recorded_read_sites,
)

__all__ = ["BUILT_IN", "Entry", "ReadSite", "Registry", "RegistrationError", "current_registrant", "describe",
           "reads", "recorded_read_sites"]
