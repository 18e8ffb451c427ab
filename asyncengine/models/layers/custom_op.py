"""CustomOp, the base of the in-tree ops and their out-of-tree replacements: in the floor,
asyncengine.interfaces.torch_bases (its docstring gives vLLM's dispatch and registration rules);
imported here for the name code and plugins have used.

This module gives CustomOp the platform phase's answer: which platform this process runs, and whether
it is out of tree (not a built-in), which decides whether `forward_oot` is a candidate.
"""

from __future__ import annotations

from typing import Any

from asyncengine.interfaces.torch_bases import CustomOp, install_platform_lookup
from asyncengine.platforms.resolution import BUILT_IN as BUILT_IN_PLATFORMS
from asyncengine.platforms.resolution import current_platform


def _current_platform() -> tuple[Any, bool]:
    platform = current_platform()
    return platform, platform not in BUILT_IN_PLATFORMS.values()


install_platform_lookup(_current_platform)

__all__ = ["CustomOp"]
