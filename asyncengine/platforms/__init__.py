"""Platforms: what a device kind needs from the engine, as one interface for built-ins and plugins.

The platform is resolved in the first start-up phase of every process (never at import time);
`current_platform()` raises until then.
"""

from asyncengine.platforms.interface import Platform
from asyncengine.platforms.resolution import current_platform

__all__ = ["Platform", "current_platform"]
