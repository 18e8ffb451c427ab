import pytest

from asyncengine.models.layers import op_registry
from asyncengine.platforms import resolution
from asyncengine.platforms.cpu import CpuPlatform


@pytest.fixture
def cpu_platform(monkeypatch):
    """The CPU platform as if resolved at start-up: the sampler's draw (op "sample") runs through the
    op providers, whose order the platform takes part in. Unit tests build a Sampler without an engine."""
    monkeypatch.setattr(resolution, "_current", CpuPlatform)
    monkeypatch.setattr(op_registry, "_chains", {})
