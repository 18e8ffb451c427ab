"""The custom-op tables (docs/reference.md, custom ops): in-tree op classes, their out-of-tree replacements,
and op providers (several implementations of one op, chosen per call).

Torch-free on purpose: the frontend builds its manifest from these registries, and a general plugin
registers into them there too, without the frontend importing torch for it. The tables and their
custom-op half live in the floor (asyncengine.interfaces.custom_op_registry), the `CustomOp` class
in interfaces/torch_bases.py; the in-tree ops (norm.py, rotary.py, activation.py) use both. The
sampler's draw is op "sample" (asyncengine/worker/sample_op.py): providers only, no class.

Two registries, read in the worker (the manifest check compares them there):
- `custom_ops`: in-tree op name -> class ("RMSNorm"), and `oot:<name>` -> the out-of-tree class that
  replaces it (`CustomOp.register_oot`). The built-in names are registered there as lazy paths, so
  every process knows them (and can refuse an unknown name) before any model module is imported.
- `op_providers`: `<op>/<provider>` -> function ("rms_norm/native"). Which provider runs is decided
  per call: the providers in priority order, the first whose `supported(*args)` says yes (or that
  has no predicate). The order: the providers named by `op_priority` in the config, else by the
  platform's `op_priority`, in that order; then the others by their registered `priority` (higher
  first, then by name); `native` (the torch reference, which supports everything) last unless named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncengine.errors import AsyncEngineError, ConfigError, ModelLoadError
from asyncengine.interfaces.imports import import_by_path

# The tables and the custom-op (class) half are in the floor, asyncengine.interfaces.custom_op_registry.
from asyncengine.interfaces.custom_op_registry import (
    BUILT_IN_PROVIDERS,
    OOT_PREFIX,
    CustomOpRegistry,
    OpProviderRegistry,
    in_tree_op_names,
)
from asyncengine.interfaces.registry import RegistrationError, describe, reads

NATIVE = "native"

# The built-in providers: "native" (the in-tree ops' torch implementations) and "triton" (the Triton
# kernels of ops/, tried before native where a CUDA device and triton are present; elsewhere left out,
# see `_Options.available`, so CPU runs are as without them). The floor's table names them by path
# (BUILT_IN_PROVIDERS); their options are set at the end of this module.
TRITON = "triton"
_TRITON_DTYPES = ("torch.float32", "torch.float16", "torch.bfloat16")
_triton_runs_here: bool | None = None


def triton_runs_here() -> bool:
    """Whether the triton providers can run in this process: triton installed and a CUDA device seen.

    Asked in the worker only (where the order is built); importing torch here would be wrong in the
    torch-free frontend, which never asks. Cached: the answer does not change within a process.
    """
    global _triton_runs_here
    if _triton_runs_here is None:
        import importlib.util

        import torch

        _triton_runs_here = importlib.util.find_spec("triton") is not None and torch.cuda.is_available()
    return _triton_runs_here


def triton_for_this_platform() -> bool:
    """The triton providers' availability: they run where triton and a CUDA device are present and the
    platform is CUDA's. A CPU platform on a machine that also has a GPU keeps `native` first, so its fused
    C kernels (norm.py's `forward_cpu`) still run (the first H100 run showed them passed over). Before a
    platform is resolved (a tool or test asking for the order) the device alone decides, as it did."""
    from asyncengine.plugin_runtime.platform_resolution import resolved_platform

    if not triton_runs_here():
        return False
    platform = resolved_platform()
    return platform is None or platform.device_type == "cuda"


def on_cuda(*args: Any) -> bool:
    """The triton providers' `supported`: every tensor argument on a CUDA device, in a dtype the kernels
    take (float32/16, bfloat16); non-tensor arguments (eps) pass. Torch-free: it reads attributes."""
    tensors = [arg for arg in args if hasattr(arg, "is_cuda")]
    return bool(tensors) and all(t.is_cuda and str(t.dtype) in _TRITON_DTYPES for t in tensors)


def sample_on_cuda(logits: Any, temperature: Any, seeds: Any, noise: Any) -> bool:
    """The triton "sample" provider's `supported`: logits on a CUDA device in a kernel dtype, the
    per-row temperature (float32) and seeds (int64) there too, noise None or float32 there."""
    def cuda(t: Any, *dtypes: str) -> bool:
        return bool(getattr(t, "is_cuda", False)) and str(t.dtype) in dtypes
    return (cuda(logits, *_TRITON_DTYPES) and cuda(temperature, "torch.float32") and cuda(seeds, "torch.int64")
            and (noise is None or cuda(noise, "torch.float32")))


# The triton providers' predicates: `on_cuda` unless an op's arguments need their own.
_TRITON_SUPPORTED: dict[str, Callable[..., bool]] = {"sample": sample_on_cuda}


class NoOpProvider(AsyncEngineError):
    """No provider of an op accepts the arguments of a call (only possible for an op without `native`)."""


# -- op providers (functions) -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    supported: Callable[..., bool] | None
    priority: int
    # Built-in providers only: whether this process can run the provider at all (the triton ones need
    # a CUDA device). One that cannot is left out of the order, so its records read as if absent.
    available: Callable[[], bool] | None = None


_options: dict[str, _Options] = {}
_config_priority: dict[str, list[str]] = {}  # `op_priority` of the config, set by the worker before the model runs
# op -> ((provider, function, supported), ...) in the order to try; rebuilt after any change.
_chains: dict[str, tuple[tuple[str, Callable[..., Any], Callable[..., bool] | None], ...]] = {}


def register_op_impl(
    op: str,
    provider: str,
    fn: Callable[..., Any] | str,
    *,
    supported: Callable[..., bool] | None = None,
    priority: int | None = None,
    override: bool = False,
) -> Callable[..., Any] | str:
    """Register `fn` (or "pkg.mod:function") as `provider`'s implementation of `op`.

    `fn` takes the op's arguments (rms_norm: `x, weight, eps`; silu_and_mul: `x`; rotary:
    `query, key, cos, sin`; sample: `logits, temperature, seeds, noise`, see asyncengine.worker.sample_op;
    fused_moe: `hidden, router_logits, w13, w2, w13_bias, w2_bias, config`, see asyncengine.ops.fused_moe).
    `supported(*args)`, when given, is asked before each call whether `fn` handles those arguments;
    no predicate means it handles all. `priority` (default 0, higher first) orders the providers that
    neither the config's nor the platform's `op_priority` names.
    """
    for label, value in (("op", op), ("provider", provider)):
        if not isinstance(value, str) or not value or "/" in value:
            raise RegistrationError(f"register_op_impl: the {label} must be a non-empty string without '/', "
                                    f"got {value!r}")
    if not (callable(fn) or isinstance(fn, str)):
        raise RegistrationError(f"register_op_impl({op!r}, {provider!r}): fn must be callable or "
                                f"'pkg.mod:function', got {fn!r}")
    if supported is not None and not callable(supported):
        raise RegistrationError(f"register_op_impl({op!r}, {provider!r}): supported must be callable or None")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise RegistrationError(f"register_op_impl({op!r}, {provider!r}): priority must be an int, got {priority!r}")
    _register_provider(op, provider, fn, _Options(supported, priority or 0), override=override)
    return fn


def _register_provider(op: str, provider: str, fn: Any, options: _Options, *, override: bool = False,
                       owner: str | None = None) -> None:
    key = f"{op}/{provider}"
    first = key not in OpProviderRegistry
    OpProviderRegistry.register(key, fn, override=override, owner=owner)
    if first or override:  # the same function again is a no-op: its first options stay
        _options[key] = options
    _chains.clear()


def op_names() -> list[str]:
    return sorted({key.partition("/")[0] for key in OpProviderRegistry.keys()})


def providers_of(op: str) -> list[str]:
    return [key.partition("/")[2] for key in OpProviderRegistry.keys() if key.partition("/")[0] == op]


def set_op_priority(priority: dict[str, list[str]] | None) -> None:
    """Install the config's `op_priority` in this process (the worker does, before it loads the model).

    A name no provider has is an error here, where the providers are known, naming the known ones.
    """
    priority = dict(priority or {})
    for op, names in priority.items():
        if op not in op_names():
            raise ConfigError(f"op_priority names op {op!r}, which has no providers; the ops are: "
                              f"{', '.join(op_names())}", field="op_priority")
        unknown = [name for name in names if name not in providers_of(op)]
        if unknown:
            raise ConfigError(f"op_priority[{op!r}] names provider(s) {', '.join(map(repr, unknown))} that op "
                              f"{op!r} does not have; its providers are: {', '.join(providers_of(op))}",
                              field="op_priority")
    _config_priority.clear()
    _config_priority.update({op: list(names) for op, names in priority.items()})
    _chains.clear()


@reads("op_providers", "worker")
def provider_order(op: str) -> tuple[list[str], str]:
    """The providers of `op` in the order they are tried, and where the preferred order came from."""
    from asyncengine.plugin_runtime.platform_resolution import current_platform

    providers = [name for name in providers_of(op) if _available(f"{op}/{name}")]
    if op in _config_priority:
        preferred, source = _config_priority[op], "op_priority in the config"
    else:
        platform = current_platform()
        preferred = (getattr(platform, "op_priority", None) or {}).get(op, [])
        source = f"the {platform.device_name} platform's order"
    # A platform may prefer providers that are not installed here: those are passed over.
    named = list(dict.fromkeys(name for name in preferred if name in providers))
    if not named:
        source = "registered priorities"
    rest = sorted((name for name in providers if name not in named and name != NATIVE),
                  key=lambda name: (-_options[f"{op}/{name}"].priority, name))
    if NATIVE in providers and NATIVE not in named:
        rest.append(NATIVE)
    return named + rest, source


def _available(key: str) -> bool:
    available = _options[key].available
    return available is None or available()


@reads("op_providers", "worker")
def _build_chain(op: str) -> tuple[tuple[str, Callable[..., Any], Callable[..., bool] | None], ...]:
    order, _ = provider_order(op)
    chain = []
    for name in order:
        entry = OpProviderRegistry.registered(f"{op}/{name}")
        fn = entry.implementation
        if isinstance(fn, str):
            fn = import_by_path(fn, what=f"op provider {name!r} of {op!r}", error=ModelLoadError)
        chain.append((name, fn, _options[f"{op}/{name}"].supported))
    _chains[op] = tuple(chain)
    return _chains[op]


def native_first(op: str) -> bool:
    """Whether `op`'s first provider is `native` (no plugin provider, and no `op_priority`, puts another
    first): an in-tree op may then run its own fused kernel for the native reference (norm.py's
    `forward_cpu`) without passing over a provider someone chose."""
    chain = _chains.get(op) or _build_chain(op)
    return bool(chain) and chain[0][0] == NATIVE


def call_op(op: str, *args: Any) -> Any:
    """Run `op` with the first provider, in priority order, that supports these arguments."""
    chain = _chains.get(op) or _build_chain(op)
    for _name, fn, supported in chain:
        if supported is None or supported(*args):
            return fn(*args)
    raise NoOpProvider(f"no provider of op {op!r} supports these arguments (tried {', '.join(n for n, _, _ in chain)})"
                       if chain else f"op {op!r} has no providers; the ops are: {', '.join(op_names())}")


def startup_records(phase: str) -> list[Any]:
    """The worker's start-up records: per op, the provider it prefers and the priority list; per
    out-of-tree replacement, the class that replaces the in-tree op."""
    import os
    import time

    from asyncengine.wire.startup import StartupRecord
    from asyncengine.plugin_runtime.records import current_process_role

    now, pid, role = time.time(), os.getpid(), current_process_role()
    return [StartupRecord(pid=pid, role=role, phase=phase, plugin=subject, reason=detail, start=now)
            for subject, detail in _choices()]


@reads("custom_ops", "worker")
def _choices() -> list[tuple[str, str]]:
    choices = []
    for op in op_names():
        order, source = provider_order(op)
        first = order[0]
        detail = f"provider {first} (priority list: {', '.join(order)}; from {source})"
        if _options[f"{op}/{first}"].supported is not None and len(order) > 1:
            detail += f"; {first} is asked per call whether it supports the arguments, else the next in the list runs"
        choices.append((f"op:{op}", detail))
    for name in in_tree_op_names():
        entry = CustomOpRegistry.get(OOT_PREFIX + name)
        if entry is not None:
            choices.append((f"custom op:{name}", f"out-of-tree class {describe(entry.implementation)} replaces "
                                                 f"the in-tree {name} (registered by {entry.owner})"))
    return choices


# The built-in providers are in the floor's table already (by path); here they get their options (the
# predicates and the availability check are this module's).
for _key in BUILT_IN_PROVIDERS:
    _op, _, _provider = _key.partition("/")
    if _provider == TRITON:
        _options[_key] = _Options(_TRITON_SUPPORTED.get(_op, on_cuda), 10, triton_for_this_platform)
    else:
        _options[_key] = _Options(None, 0)
