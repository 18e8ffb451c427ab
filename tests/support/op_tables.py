"""`private_op_tables(monkeypatch)`: the custom-op and op-provider tables (and the provider order's state) copied
for one test, on the CPU platform, so that what the test registers is gone after it (registrations are
process-wide)."""

from __future__ import annotations

from asyncengine.models.layers import op_registry
from asyncengine.models.layers.op_registry import CustomOpRegistry, OpProviderRegistry
from asyncengine.platforms import resolution
from asyncengine.platforms.cpu import CpuPlatform


def private_op_tables(monkeypatch) -> None:
    for registry in (CustomOpRegistry, OpProviderRegistry):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    monkeypatch.setattr(op_registry, "_options", dict(op_registry._options))
    monkeypatch.setattr(op_registry, "_config_priority", {})
    monkeypatch.setattr(op_registry, "_chains", {})
    monkeypatch.setattr(resolution, "_current", CpuPlatform)
