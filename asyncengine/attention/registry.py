"""The attention-backend registry: name -> AttentionBackend subclass (or its "pkg.mod:Class" path).

The built-ins "TORCH_PAGED" and "TRITON_PAGED" register here in code, through the same door a plugin uses:
`register_attention_backend("NAME", "pkg.mod:Backend")`, from a general plugin so that every process
has it (the worker reads it; the manifest check names a key the frontend has and a worker lacks).
The platform's `get_attn_backend_cls` (or the `attention_backend` option) names the backend to use.
"""

from __future__ import annotations

from typing import Any

# The table lives in the floor (asyncengine.interfaces.attention), next to the class it holds.
from asyncengine.interfaces.attention import AttentionBackendRegistry


def register_attention_backend(name: str, backend: Any = None, *, override: bool = False) -> Any:
    """Register `backend` (an AttentionBackend subclass, or "pkg.mod:Class") under `name`; without
    `backend`, a class decorator: `@register_attention_backend("NAME")`."""
    if backend is not None:
        AttentionBackendRegistry.register_backend(name, backend, override=override)
        return backend

    def register(cls: type) -> type:
        AttentionBackendRegistry.register_backend(name, cls, override=override)
        return cls

    return register


__all__ = ["register_attention_backend"]
