"""Resolving a platform for one test, as the platform phase does (set_current_platform tells the floor's
readers: CustomOp's dispatch, vLLM's config views), and putting the process's previous state back after it."""

from __future__ import annotations

from typing import Any

from asyncengine.config import vllm_views
from asyncengine.interfaces import custom_op_registry
from asyncengine.plugin_runtime import platform_resolution


def use_platform(monkeypatch: Any, platform: Any) -> None:
    monkeypatch.setattr(platform_resolution, "_current", platform_resolution._current)
    monkeypatch.setattr(platform_resolution, "_current_key", platform_resolution._current_key)
    monkeypatch.setattr(custom_op_registry, "_dispatch_platform", custom_op_registry._dispatch_platform)
    monkeypatch.setattr(vllm_views, "_platform", list(vllm_views._platform))
    platform_resolution.set_current_platform(platform)
