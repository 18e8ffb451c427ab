"""AttentionBackend: the interface every attention backend implements (the built-in one included), and
the registry that names them (AttentionBackendRegistry, read in the worker).

The worker builds one instance per attention layer, once the model is loaded, with that layer's shape.
Every step the layer calls `forward` with the step's queries, keys and values, its KV cache and the
step's metadata; the backend stores the new keys and values in the cache and attends. What it is given:

- `query` `[num_tokens, num_heads, head_dim]`; `key`, `value` `[num_tokens, num_kv_heads, head_dim]`
  (rotary already applied), in the batch's flat token order;
- `kv_cache`: `(key_cache, value_cache)`, each `[num_kv_heads, num_blocks, block_size, head_dim]`, zeroed
  at allocation; the model runner owns the layout, so a backend reads and writes it as it is;
- `metadata` (`asyncengine.models.layers.attention.AttentionMetadata`): `slot_mapping` (cache slot of
  each new token: `block_id * block_size + offset`), `query_lens` and `seq_lens` (per sequence: tokens
  new this step, and its context length after it), `block_tables` `[num_seqs, max_blocks]` int64 on the
  device, and `plan` (the torch path's per-step plan, shared by all layers).

It returns `[num_tokens, num_heads, head_dim]`: row `i` is token `i`'s causal attention over its own
sequence's context. No torch import here: `asyncengine.plugins_api` exports this class without torch.
"""

from __future__ import annotations

from typing import Any

from asyncengine.config.class_paths import is_class_path
from asyncengine.errors import ConfigError, ModelLoadError
from asyncengine.interfaces.imports import import_by_path
from asyncengine.interfaces.registry import BUILT_IN, Registry


class AttentionBackend:
    """Subclass it, implement `forward`, and register the class (or its "pkg.mod:Class" path) with
    `register_attention_backend("NAME", ...)` from a general plugin."""

    # Set True only if, in a decode step (`metadata.decode_only`), `forward` reads nothing of the
    # metadata but its device tensors (`slot_mapping`, `block_tables`, `seq_lens_tensor`,
    # `query_start_loc`), sizes every launch from shapes (`metadata.max_seq_len` is None then), skips
    # negative slots and writes finite output for rows whose `seq_lens_tensor` is 0: the model runner
    # may then replay decode steps from CUDA graphs (asyncengine/worker/cuda_graphs.py).
    cuda_graph_safe = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, query: Any, key: Any, value: Any, kv_cache: tuple[Any, Any], metadata: Any) -> Any:
        raise NotImplementedError(f"{type(self).__qualname__} must implement "
                                  "forward(query, key, value, kv_cache, metadata)")


# -- the registry --------------------------------------------------------------------------------------
# The built-ins "TORCH_PAGED" and "TRITON_PAGED" register here in code, through the same door a plugin
# uses: `register_attention_backend("NAME", "pkg.mod:Backend")`, from a general plugin so that every
# process has it (the worker reads it). The platform's `get_attn_backend_cls` (or the
# `attention_backend` option) names the backend to use.

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
            backend = import_by_path(backend, what=f"attention backend {name!r}", error=ModelLoadError)
        if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
            raise ConfigError(f"attention backend {name!r}{by} is {backend!r} ({origin}), not an "
                              "AttentionBackend subclass", field=field)
        return backend


AttentionBackendRegistry = _AttentionBackendRegistry()


__all__ = ["TORCH_PAGED", "TRITON_PAGED", "AttentionBackend", "AttentionBackendRegistry"]
