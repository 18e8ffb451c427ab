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

import inspect
from typing import Any

from asyncengine.config.class_paths import is_class_path
from asyncengine.errors import ConfigError, ModelLoadError, StartupError
from asyncengine.interfaces.imports import import_by_path
from asyncengine.interfaces.registry import BUILT_IN, Registry, describe


class AttentionBackend:
    """Subclass it, implement `forward`, and register the class (or its "pkg.mod:Class" path) with
    `register_attention_backend("NAME", ...)` from a general plugin."""

    # Set True only if, in a decode step (`metadata.decode_only`), `forward` reads nothing of the
    # metadata but its device tensors (`slot_mapping`, `block_tables`, `seq_lens_tensor`,
    # `query_start_loc`), sizes every launch from shapes (`metadata.max_seq_len` is None then), skips
    # negative slots and writes finite output for rows whose `seq_lens_tensor` is 0: the model runner
    # may then replay decode steps from CUDA graphs (asyncengine/worker/cuda_graphs.py).
    cuda_graph_safe = False
    # What a layer may need beyond causal attention (the worker sets them on the layer's instance, after
    # building it): `sliding_window` (each query sees only its last N keys, and the blocks before them may be
    # stale or the null block: docs/engine.md, the hybrid KV cache) and `logits_soft_cap` (scores become
    # `cap * tanh(score / cap)` before the softmax, Gemma 2) and `sinks` (a learned logit per query head that
    # joins each row's softmax and takes its share of the probability, attending to nothing: GPT-OSS; a tensor
    # `[num_heads]` of this rank's heads, float32 or the model dtype). A backend that does not declare the support
    # serves no layer that needs it (the worker names the layer and the feature; see attention/selector.py).
    supports_sliding_window = False
    supports_logits_soft_cap = False
    supports_sinks = False
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: Any = None

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


class _AttentionBackendRegistry(Registry[type[AttentionBackend]]):
    def __init__(self) -> None:
        super().__init__("attention_backends", "attention backend", AttentionBackend, field="attention_backend")
        # A lazy path: the registry (imported in every process, for the manifest) stays free of torch.
        self.register(TORCH_PAGED, "asyncengine.attention.torch_paged:TorchPagedBackend", owner=BUILT_IN)
        # The Triton kernels (ops/triton_attention.py); only the CUDA platform chooses it.
        self.register(TRITON_PAGED, "asyncengine.attention.triton_paged:TritonPagedBackend", owner=BUILT_IN)

    def problem(self, implementation: Any) -> str | None:
        # vLLM's descriptor form is a backend too: the selector adapts it (descriptor_implementation).
        return None if is_descriptor(implementation) else super().problem(implementation)

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
        if is_descriptor(backend):  # vLLM's form: the implementation is get_impl_cls()'s answer
            return descriptor_implementation(name, backend, f"{origin}{', chosen by ' + chosen_by if by else ''}")
        if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
            raise ConfigError(f"attention backend {name!r}{by} is {backend!r} ({origin}), not an "
                              "AttentionBackend subclass", field=field)
        return backend


AttentionBackendRegistry = _AttentionBackendRegistry()


# -- vLLM's descriptor form -------------------------------------------------------------------------------
# vLLM's backend is a descriptor class: get_name(), get_impl_cls() (the implementation, with forward),
# get_builder_cls() (its metadata builder), get_kv_cache_shape(...). Here the model runner owns the KV cache
# layout and builds the metadata, so only get_impl_cls is asked: its class is the implementation, built as
# ours are (or with vLLM's constructor keywords) and given our forward's arguments.

# vLLM's AttentionImpl constructor, by keyword: what each of our four arguments is called there.
_VLLM_INIT_NAMES = {"num_heads": "num_heads", "head_size": "head_dim", "scale": "scale", "num_kv_heads": "num_kv_heads"}
# Its other parameters, given their meaning here when the implementation declares them without a default.
_VLLM_INIT_DEFAULTS: dict[str, Any] = {"alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto",
                       "logits_soft_cap": None, "attn_type": "decoder", "kv_sharing_target_layer_name": None}


def is_descriptor(backend: Any) -> bool:
    """vLLM's form: a class with get_impl_cls and no forward of its own."""
    if not (isinstance(backend, type) and callable(getattr(backend, "get_impl_cls", None))):
        return False
    forward = getattr(backend, "forward", None)
    return forward is None or forward is AttentionBackend.forward


def descriptor_implementation(name: str, descriptor: type, origin: str) -> Any:
    """The implementation class vLLM's descriptor names; a StartupError saying what to change when it
    cannot serve as ours (no forward, or vLLM's forward(layer, ..., attn_metadata))."""
    who = f"attention backend {name!r} ({describe(descriptor)}, {origin}) is vLLM's descriptor form"
    static = inspect.getattr_static(descriptor, "get_impl_cls")
    try:  # vLLM's is a staticmethod; its older examples use an instance method on a default-built descriptor
        on: Any = descriptor if isinstance(static, (staticmethod, classmethod)) else descriptor()
        implementation = on.get_impl_cls()
    except Exception as exc:  # the plugin's own failure, named
        raise StartupError(f"{who}; its get_impl_cls() raised {type(exc).__name__}: {exc}") from exc
    returned = describe(implementation) if isinstance(implementation, type) else repr(implementation)
    told = f"{who}; get_impl_cls() returned {returned}"
    if not isinstance(implementation, type):
        raise StartupError(f"{told}, not a class (docs/porting.md#attention-backends)")
    forward = getattr(implementation, "forward", None)
    if not callable(forward) or forward is AttentionBackend.forward:
        raise StartupError(f"{told}, which defines no forward(query, key, value, kv_cache, metadata) "
                           "(docs/porting.md#attention-backends)")
    parameters = list(inspect.signature(forward).parameters)
    if parameters[1:3] == ["layer", "query"] or "attn_metadata" in parameters:
        raise StartupError(f"{told}, whose forward is vLLM's ({', '.join(parameters[1:])}): here it is "
                           "forward(query, key, value, kv_cache, metadata), kv_cache being (key_cache, value_cache), "
                           "each [num_kv_heads, num_blocks, block_size, head_dim], and metadata our AttentionMetadata "
                           "(docs/porting.md#attention-backends)")
    try:
        inspect.signature(forward).bind(None, None, None, None, None, None)
    except TypeError as exc:
        raise StartupError(f"{told}, whose forward cannot be called as forward(query, key, value, kv_cache, "
                           f"metadata): {exc} (docs/porting.md#attention-backends)") from exc
    return implementation


def build_backend(backend: type, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None, sinks: Any = None) -> Any:
    """One layer's backend instance: `backend(num_heads, num_kv_heads, head_dim, scale)`, ours, or by
    vLLM's keywords (`num_heads, head_size, scale, num_kv_heads, ...`, the layer's `sliding_window` and
    `logits_soft_cap` and `sinks` among them) when its constructor names head_size. The layer's sliding window,
    soft cap and sinks are then set on the instance (the attributes AttentionBackend declares)."""
    try:
        parameters = dict(inspect.signature(backend).parameters)
    except (TypeError, ValueError):  # a constructor Python cannot inspect: ours, positionally
        parameters = {}
    if "head_size" not in parameters:
        instance = backend(num_heads, num_kv_heads, head_dim, scale)
    else:
        ours = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "scale": scale}
        keywords: dict[str, Any] = {vllm_name: ours[our_name] for vllm_name, our_name in _VLLM_INIT_NAMES.items()
                                    if vllm_name in parameters}
        keywords.update({name: value for name, value in _VLLM_INIT_DEFAULTS.items()
                         if name in parameters and parameters[name].default is inspect.Parameter.empty})
        for name, value in (("sliding_window", sliding_window), ("logits_soft_cap", logits_soft_cap),
                            ("sinks", sinks)):
            if name in parameters:
                keywords[name] = value
        instance = backend(**keywords)
    instance.sliding_window, instance.logits_soft_cap, instance.sinks = sliding_window, logits_soft_cap, sinks
    return instance


def missing_features(backend: type, sliding_window: int | None, logits_soft_cap: float | None,
                     sinks: Any = None) -> list[str]:
    """What a layer needs that `backend` (a class) does not declare it supports."""
    missing = []
    if sliding_window is not None and not getattr(backend, "supports_sliding_window", False):
        missing.append(f"a sliding window ({sliding_window} tokens)")
    if logits_soft_cap is not None and not getattr(backend, "supports_logits_soft_cap", False):
        missing.append(f"attention logit soft-capping ({logits_soft_cap})")
    if sinks is not None and not getattr(backend, "supports_sinks", False):
        missing.append("attention sinks")
    return missing


__all__ = ["TORCH_PAGED", "TRITON_PAGED", "AttentionBackend", "AttentionBackendRegistry", "build_backend",
           "is_descriptor", "missing_features"]
