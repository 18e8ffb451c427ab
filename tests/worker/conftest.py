import pytest

from asyncengine.models.layers import op_registry
from asyncengine.plugin_runtime import platform_resolution as resolution
from asyncengine.platforms.cpu import CpuPlatform
from support.platforms import use_platform


@pytest.fixture
def cpu_platform(monkeypatch):
    """The CPU platform as if resolved at start-up: the sampler's draw (op "sample") runs through the
    op providers, whose order the platform takes part in. Unit tests build a Sampler without an engine."""
    use_platform(monkeypatch, CpuPlatform)
    monkeypatch.setattr(op_registry, "_chains", {})
