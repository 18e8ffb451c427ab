"""Whether torch in this process can place tensors on a platform's device.

A platform plugin may name a device that torch has no backend for here (vLLM's test platform uses
`device_type = "privateuseone"`, which a device's torch extension registers when it is imported).
Resolving such a platform, its hooks and `current_platform.device_name` all work; only placing a
model on the device cannot, and the worker checks that first, so that the error names the platform
and says what to do, rather than torch's words from deep inside the first tensor it builds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncengine.errors import StartupError

if TYPE_CHECKING:
    from asyncengine.interfaces.platform import Platform


def check_torch_device(platform: type[Platform], device: Any) -> None:
    """Raise StartupError when torch cannot allocate on `device` (a torch.device of `platform`'s type)."""
    if device.type == "cpu":
        return
    import torch

    try:
        torch.empty(0, device=device)
    except Exception as exc:  # torch's ways of saying "no such backend here" vary (RuntimeError, ImportError,
        # AssertionError for CUDA): each is re-raised as this, with torch's own words kept
        torch_says = (str(exc).strip().splitlines() or [repr(exc)])[0]
        raise StartupError(
            f"platform {platform.device_name} ({platform.__module__}.{platform.__qualname__}): its device_type "
            f"{platform.device_type!r} has no torch backend in this process, so no model can be placed on it "
            f"(torch: {type(exc).__name__}: {torch_says}); "
            "import the torch extension that provides the device before the model loads (in the platform "
            "plugin's module, or its set_device hook), or choose another platform with --device") from exc
