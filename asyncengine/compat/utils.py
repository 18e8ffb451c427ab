"""vLLM's small helpers that plugins import (`vllm.utils`, `vllm.utils.math_utils`, `vllm.utils.network_utils`,
`vllm.model_executor.utils.set_weight_attrs`), written here with vLLM's names and behaviour."""

from __future__ import annotations

import socket
import uuid
from typing import Any


def cdiv(a: int, b: int) -> int:
    """The ceiling of a / b."""
    return -(a // -b)


def round_up(x: int, y: int) -> int:
    """x rounded up to a multiple of y."""
    return ((x + y - 1) // y) * y


def round_down(x: int, y: int) -> int:
    """x rounded down to a multiple of y."""
    return (x // y) * y


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least n (1 for n < 1)."""
    return 1 if n < 1 else 1 << (n - 1).bit_length()


def random_uuid() -> str:
    return uuid.uuid4().hex


def get_ip() -> str:
    """This host's address by its name (127.0.0.1 when the name does not resolve)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def get_open_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def is_pin_memory_available() -> bool:
    """vLLM's utility, asked of this process's platform."""
    from asyncengine.plugin_runtime.platform_resolution import current_platform

    return bool(current_platform().is_pin_memory_available())


def set_weight_attrs(weight: Any, weight_attrs: dict[str, Any] | None) -> None:
    """vLLM's: set attributes on a parameter (its `weight_loader`, `output_dim`, ...); refusing to overwrite
    one already set, as vLLM's does (with an error here, not an assert)."""
    if weight_attrs is None:
        return
    for key, value in weight_attrs.items():
        if hasattr(weight, key):
            raise AttributeError(f"set_weight_attrs: the parameter already has {key!r}; vLLM refuses to overwrite "
                                 "it, and so does asyncengine")
        setattr(weight, key, value)


__all__ = ["cdiv", "get_ip", "get_open_port", "is_pin_memory_available", "next_power_of_2", "random_uuid",
           "round_down", "round_up", "set_weight_attrs"]
