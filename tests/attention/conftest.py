"""Fixtures of the attention backend tests."""

from __future__ import annotations

import pytest

import asyncengine.attention.registry as registry_module
import asyncengine.attention.selector as selector_module
from asyncengine.interfaces.attention import _AttentionBackendRegistry


@pytest.fixture
def fresh_registry(monkeypatch):
    """A registry of the same kind with only the built-in, in place of the process-wide one."""
    fresh = _AttentionBackendRegistry()
    monkeypatch.setattr(registry_module, "AttentionBackendRegistry", fresh)
    monkeypatch.setattr(selector_module, "AttentionBackendRegistry", fresh)
    return fresh
