"""The process roles, named once: every table of who reads what (registries, hooks, plugin groups,
start-up phases) and every start-up record uses these strings.

A process plays one or more roles: the frontend (the API server or the embedding application), the
engine core (scheduler, KV-cache manager, executor) and the worker (one per tensor-parallel rank).
"""

from __future__ import annotations

FRONTEND, ENGINE_CORE, WORKER = "frontend", "engine core", "worker"
ROLES = (FRONTEND, ENGINE_CORE, WORKER)

__all__ = ["ENGINE_CORE", "FRONTEND", "ROLES", "WORKER"]
