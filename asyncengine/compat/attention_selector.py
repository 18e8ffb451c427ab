"""vLLM's older attention selector, `get_attn_backend(...)`, and its `PlaceholderAttentionBackend`.

`get_attn_backend(head_size, dtype, kv_cache_dtype, block_size, is_attention_free, ...)` asks this
process's platform (`current_platform`, which raises until the platform phase has run) which backend
serves layers of that shape, as our worker asks it (by keyword, with vLLM's parameter names), and
returns the class the answer names: a registered name, a class path (vLLM's dotted form too) or a
class. A vLLM descriptor comes back as the descriptor, as vLLM's selector returns it; the worker
serves it through its `get_impl_cls()`.

`PlaceholderAttentionBackend` is vLLM's backend for attention-free models, which asyncengine has
none of: a subclass can be named and asked (`get_name()`, `get_impl_cls()`), and a model that would
run on it fails at start-up, saying why.
"""

from __future__ import annotations

from typing import Any

from asyncengine.interfaces.attention import AttentionBackendRegistry
from asyncengine.config.class_paths import is_class_path
from asyncengine.errors import StartupError
from asyncengine.interfaces.attention import AttentionBackend
from asyncengine.interfaces.imports import import_by_path
from asyncengine.interfaces.registry import reads
from asyncengine.platforms.interface import ask_attn_backend, attn_backend_name
from asyncengine.plugin_runtime.platform_resolution import current_platform


@reads("attention_backends", "worker")  # vLLM asks it in the worker; here only a plugin's test calls it
def get_attn_backend(head_size: int, dtype: Any, kv_cache_dtype: Any = None, block_size: int = 16,
                     is_attention_free: bool = False, *_vllm_only: Any, **_vllm_keywords: Any) -> type:
    """The backend class this process's platform chooses for layers of `head_size` and `dtype` (vLLM's
    signature; its later positional and keyword parameters are accepted and have no meaning here)."""
    platform = current_platform()  # a StartupError before the platform phase, naming what to run first
    answer = ask_attn_backend(platform, head_size, dtype, block_size, kv_cache_dtype=kv_cache_dtype)
    if isinstance(answer, type):
        return answer
    name = attn_backend_name(answer)
    if name is None:
        raise StartupError(f"platform {platform.device_name}: get_attn_backend_cls(head_size={head_size}, ...) "
                           f"returned {answer!r}; it must return a registered attention backend name "
                           f"(registered: {', '.join(AttentionBackendRegistry.keys())}) or a class path")
    entry = AttentionBackendRegistry.get(name)
    if entry is not None:
        backend = entry.implementation
    elif is_class_path(name):
        backend = name
    else:
        raise StartupError(f"platform {platform.device_name} chose the attention backend {name!r}, which is not "
                           f"registered (registered: {', '.join(AttentionBackendRegistry.keys())})")
    if isinstance(backend, str):
        backend = import_by_path(backend, what=f"attention backend {name!r}", error=StartupError)
    return backend


class PlaceholderAttentionImpl:
    """What PlaceholderAttentionBackend.get_impl_cls() gives: no model here can run on it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise StartupError("PlaceholderAttentionBackend is vLLM's backend of attention-free models, and "
                           "asyncengine has none: a backend that serves a model names, in get_impl_cls(), an "
                           "implementation with forward(query, key, value, kv_cache, metadata) "
                           "(docs/porting.md#attention-backends)")

    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: Any) -> Any:
        raise StartupError("PlaceholderAttentionImpl cannot run attention")  # never built: __init__ refuses


class PlaceholderAttentionBackend(AttentionBackend):
    """vLLM's descriptor of the placeholder backend (vllm.attention.backends.placeholder_attn)."""

    @staticmethod
    def get_name() -> str:
        return "NO_ATTENTION"

    @staticmethod
    def get_impl_cls() -> type:
        return PlaceholderAttentionImpl

    @staticmethod
    def get_builder_cls() -> type:
        raise NotImplementedError("asyncengine builds the attention metadata itself")

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (1, 1, 1, 1, 1)  # vLLM's placeholder keeps no KV cache
