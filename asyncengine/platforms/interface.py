"""Asking a platform for its attention backend as vLLM does (`ask_attn_backend`).

The Platform interface itself is in the floor, asyncengine.interfaces.platform (docs/reference.md,
"The Platform interface").
"""

from __future__ import annotations

import inspect
from typing import Any

from asyncengine.interfaces.attention import AttentionBackend
from asyncengine.interfaces.platform import AttentionSelectorConfig, Platform
from asyncengine.interfaces.registry import describe
from asyncengine.interfaces.plugin_code import plugin_hook


def _torch_dtype(dtype: Any) -> Any:
    """A dtype named by a string ("bfloat16") as torch's object, which vLLM's platforms compare against."""
    if isinstance(dtype, str):
        import torch

        return getattr(torch, dtype, dtype)
    return dtype


# What the worker knows when it asks for an attention backend, under each name vLLM's platforms use for
# it (vLLM passes keywords; its signatures changed over releases), and our own names. The newest form is
# one argument, `attn_selector_config` (vLLM's AttentionSelectorConfig, with the same fields).
def _attn_backend_arguments(head_dim: int, dtype: Any, block_size: int, kv_cache_dtype: Any = None) -> dict[str, Any]:
    selector = AttentionSelectorConfig(head_size=head_dim, dtype=_torch_dtype(dtype),
                                       kv_cache_dtype=kv_cache_dtype or "auto", block_size=block_size)
    return {"head_size": head_dim, "head_dim": head_dim, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
            "block_size": block_size, "use_v1": True, "use_mla": False, "has_sink": False, "use_sparse": False,
            "selected_backend": None, "backend_name": None, "backend": None, "attn_selector_config": selector,
            "num_heads": None}


def ask_attn_backend(platform: type[Platform], head_dim: int, dtype: Any, block_size: int, *,
                     kv_cache_dtype: Any = None) -> Any:
    """Call the platform's get_attn_backend_cls as vLLM does, by keyword, giving each parameter its
    signature names; ours (head_dim, dtype, block_size) are among them. A method written for an
    instance (vLLM's platforms are instances) is called on one. A parameter with no known meaning and
    no default is an error naming it."""
    method = platform.get_attn_backend_cls
    if not isinstance(inspect.getattr_static(platform, "get_attn_backend_cls"), (classmethod, staticmethod)):
        method = platform().get_attn_backend_cls
    known = _attn_backend_arguments(head_dim, dtype, block_size, kv_cache_dtype)
    arguments: dict[str, Any] = {}
    for name, parameter in inspect.signature(method).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if name in known:
            arguments[name] = known[name]
        elif parameter.default is parameter.empty:
            from asyncengine.errors import StartupError

            raise StartupError(
                f"platform {platform.device_name}: get_attn_backend_cls has a parameter {name!r} that asyncengine "
                f"cannot fill; it passes {', '.join(sorted(known))} by keyword: give {name!r} a default")
    with plugin_hook(platform, "get_attn_backend_cls"):
        return method(**arguments)


def attn_backend_name(answer: Any) -> str | None:
    """A platform's answer (from ask_attn_backend) as a name or path; None when it is neither."""
    if isinstance(answer, type) and issubclass(answer, AttentionBackend):
        return describe(answer)  # a class, not a name: resolved as its path
    return answer if isinstance(answer, str) and answer else None


__all__ = ["ask_attn_backend", "attn_backend_name"]
