"""An out-of-tree platform, `cpu_example`: a CPU variant with its own worker class and attention backend.

    [project.entry-points."asyncengine.platform_plugins"]
    cpu_example = "ae_platform_example:detect"
    [project.entry-points."asyncengine.general_plugins"]
    ae_platform_example = "ae_platform_example:register"

Activation. An active out-of-tree platform wins over the built-ins (EXTENSION_POINTS.md, E2), so a
detector that always answered would take over every run on a machine where this is installed. This
one answers only when asked for: `--device cpu_example` (`device="cpu_example"`), which the frontend
then passes to its children, or the environment variable AE_PLATFORM_EXAMPLE=1 for auto-detection.
Otherwise it returns None and the built-in cpu/cuda detection goes on as if it were not installed.

This package imports only asyncengine.plugins_api, and no torch at import: every process imports it.
"""

from __future__ import annotations

import os

from asyncengine.plugins_api import register_attention_backend, requested_device

__all__ = ["ACTIVATE_ENV", "ATTENTION_BACKEND", "DEVICE_NAME", "PLATFORM_CLASS", "WORKER_CLASS", "detect", "register"]

DEVICE_NAME = "cpu_example"  # the entry-point name too: --device names a platform plugin by it
ACTIVATE_ENV = "AE_PLATFORM_EXAMPLE"
PLATFORM_CLASS = "ae_platform_example.platform:CpuExamplePlatform"
WORKER_CLASS = "ae_platform_example.worker:ExampleWorker"
ATTENTION_BACKEND = "EXAMPLE_SDPA"


def detect() -> str | None:
    """The platform's class path when asked for; None otherwise (see the module's docstring)."""
    requested = requested_device()
    if requested == DEVICE_NAME or os.environ.get(ACTIVATE_ENV) == "1":
        from ae_platform_example.record import record

        record("detected", why=f"device {requested!r}" if requested else f"{ACTIVATE_ENV}=1")
        return PLATFORM_CLASS
    return None


def register() -> None:
    """General plugin: the attention backend the platform chooses, by path (registering imports no torch).
    It is registered whether or not the platform is active: a name in a registry changes no run."""
    register_attention_backend(ATTENTION_BACKEND, "ae_platform_example.attention:ExampleSdpaBackend")
