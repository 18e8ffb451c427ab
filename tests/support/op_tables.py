"""`private_op_tables(monkeypatch)`: the custom-op and op-provider tables (and the provider order's state) copied
for one test, on the CPU platform, so that what the test registers is gone after it (registrations are
process-wide)."""

from __future__ import annotations

from asyncengine.models.layers import op_registry
from asyncengine.interfaces.custom_op_registry import CustomOpRegistry, OpProviderRegistry
from asyncengine.plugin_runtime import platform_resolution as resolution
from asyncengine.platforms.cpu import CpuPlatform
from support.platforms import use_platform


def private_op_tables(monkeypatch) -> None:
    for registry in (CustomOpRegistry, OpProviderRegistry):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    monkeypatch.setattr(op_registry, "_options", dict(op_registry._options))
    monkeypatch.setattr(op_registry, "_config_priority", {})
    monkeypatch.setattr(op_registry, "_chains", {})
    use_platform(monkeypatch, CpuPlatform)
