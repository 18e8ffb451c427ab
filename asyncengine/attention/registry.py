"""The attention-backend registry: name -> AttentionBackend subclass (or its "pkg.mod:Class" path).

The built-ins "TORCH_PAGED" and "TRITON_PAGED" register here in code, through the same door a plugin uses:
`register_attention_backend("NAME", "pkg.mod:Backend")`, from a general plugin so that every process
has it (the worker reads it; the manifest check names a key the frontend has and a worker lacks).
The platform's `get_attn_backend_cls` (or the `attention_backend` option) names the backend to use.
"""

from __future__ import annotations

from typing import Any

from asyncengine.attention.backend import AttentionBackend
from asyncengine.errors import ConfigError
from asyncengine.registries.base import BUILT_IN, Registry

TORCH_PAGED = "TORCH_PAGED"
TRITON_PAGED = "TRITON_PAGED"


class _AttentionBackendRegistry(Registry):
    def __init__(self) -> None:
        super().__init__("attention_backends", "attention backend")
        # A lazy path: the registry (imported in every process, for the manifest) stays free of torch.
        self.register(TORCH_PAGED, "asyncengine.attention.torch_paged:TorchPagedBackend", owner=BUILT_IN)
        # The Triton kernels (ops/triton_attention.py); only the CUDA platform chooses it.
        self.register(TRITON_PAGED, "asyncengine.attention.triton_paged:TritonPagedBackend", owner=BUILT_IN)

    def register_backend(self, name: str, backend: Any, *, override: bool = False) -> None:
        self.register(name, backend, override=override)

    def backend_class(self, name: str, *, chosen_by: str = "", field: str | None = None) -> type[AttentionBackend]:
        """The class registered under `name`. A "pkg.mod:Class" path that is no key is imported as it
        is (vLLM's platforms answer with class paths). Anything else names the registered backends."""
        from asyncengine.config.class_paths import is_class_path
        from asyncengine.models.registry import import_by_path

        by = f" (chosen by {chosen_by})" if chosen_by else ""
        entry = self.get(name) if isinstance(name, str) else None
        if entry is not None:
            backend, origin = entry.implementation, f"registered by {entry.owner}"
        elif is_class_path(name):  # "pkg.mod:Class", or vLLM's "pkg.mod.Class"
            backend, origin = name, "a class path, not a registered name"
        else:
            raise ConfigError(
                f"attention backend {name!r}{by} is not registered; registered: {', '.join(self.keys())} "
                "(a plugin adds one with register_attention_backend, from a general plugin so that the "
                "worker processes have it too)", field=field)
        if isinstance(backend, str):
            backend = import_by_path(backend, what=f"attention backend {name!r}")
        if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
            raise ConfigError(f"attention backend {name!r}{by} is {backend!r} ({origin}), not an "
                              "AttentionBackend subclass", field=field)
        return backend


AttentionBackendRegistry = _AttentionBackendRegistry()


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


__all__ = ["TORCH_PAGED", "TRITON_PAGED", "AttentionBackendRegistry", "register_attention_backend"]
