"""Registries that plugins fill, and which process reads each: the table is in the floor,
asyncengine.interfaces.tables (with the Registry type, asyncengine.interfaces.registry); imported here for
the names code has used."""

from __future__ import annotations

from asyncengine.interfaces.registry import BUILT_IN, Registry, RegistrationError, current_registrant
from asyncengine.interfaces.roles import ENGINE_CORE, FRONTEND, WORKER
from asyncengine.interfaces.tables import READER_MODULES, all_registries

__all__ = ["BUILT_IN", "ENGINE_CORE", "FRONTEND", "READER_MODULES", "WORKER", "Registry", "RegistrationError",
           "all_registries", "current_registrant"]
