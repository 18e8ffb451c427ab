"""Choosing the platform: the first start-up phase of every process.

Precedence (docs/reference.md, platform plugins): `--device` names one (a built-in, or a platform plugin by its
entry-point name); else exactly one active out-of-tree platform wins over the built-ins; two active
ones are an error naming both; else `cuda` when a GPU is usable, else `cpu`. Every detector's
verdict is a record; a detector that raises is an error, never a silent fallback. A platform class
that lacks an identity attribute or a hook fails here, naming it.
"""

from __future__ import annotations

import time

from asyncengine.config.vllm_views import remember_platform
from asyncengine.errors import ConfigError, StartupError
from asyncengine.interfaces.custom_op_registry import publish_dispatch_platform
from asyncengine.plugin_runtime.discovery import InstalledPlugin
from asyncengine.plugin_runtime.groups import PHASE_PLATFORM
from asyncengine.plugin_runtime.loader import NOT_LOADED, PluginLoader
from asyncengine.plugin_runtime.records import FAILED, OK, SKIPPED, StartupTrace, format_failure
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.platforms.cuda import CudaPlatform
from asyncengine.interfaces.platform import Platform

BUILT_IN: dict[str, type[Platform]] = {"cpu": CpuPlatform, "cuda": CudaPlatform}

_current: type[Platform] | None = None
_current_key: str | None = None  # the name it was resolved by: a built-in's, or the platform plugin's entry point
_requested: str | None = None


def _resolved() -> type[Platform]:
    if _current is None:
        raise StartupError(
            "the platform is not resolved yet: it is chosen in the first start-up phase of a process "
            "(AsyncEngine.start, LLM(...), the CLI); code that needs it must run after that"
        )
    return _current


class _CurrentPlatform:
    """`current_platform()` gives the platform class this process resolved at start-up; as in vLLM,
    `current_platform.device_name` (attribute access) works too, on an instance of that class, so a
    platform's instance methods work as well as its class methods. Both raise before resolution
    (never guess)."""

    _instances: dict[type, Platform] = {}

    def __call__(self) -> type[Platform]:
        return _resolved()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        platform = _resolved()
        instance = self._instances.get(platform)
        if instance is None:
            instance = self._instances[platform] = platform()
        return getattr(instance, name)

    def __repr__(self) -> str:
        return f"<current_platform: {_current.__name__ if _current else 'not resolved yet'}>"


current_platform = _CurrentPlatform()


def resolved_platform() -> type[Platform] | None:
    """The platform this process resolved, or None before its platform phase: for a reader that has an
    answer without one (the op providers' availability, asked outside a worker in tests and tools)."""
    return _current


def current_platform_key() -> str:
    """The name this process resolved its platform by (`--device`, a built-in, or the entry-point name of
    a platform plugin, which may differ from its class's device_name). A child is told this name, so
    it resolves the same platform."""
    platform = _resolved()
    key = _current_key or platform.device_name
    if key is None:  # resolution checks device_name; set_current_platform(cls) without a key does not
        raise StartupError(f"the platform {platform.__qualname__} has no device_name: set it ('cpu', 'cuda', or "
                           "the plugin's name)")
    return key


def requested_device() -> str | None:
    """The device this process's platform phase was asked for (`--device`, or the frontend's choice in
    a child); None while detecting. A platform plugin's detector reads it to stay inactive unless it is
    named, so that installing it does not take over every run (an active one wins over the built-ins)."""
    return _requested


def set_current_platform(platform: type[Platform] | None, key: str | None = None) -> None:
    global _current, _current_key
    _current, _current_key = platform, key
    # The floor's readers of the platform learn it here, from the phase that owns it (importing a module
    # installs nothing): dtype "auto" in vLLM's config views, and CustomOp's forward dispatch.
    remember_platform(platform)
    publish_dispatch_platform(platform, platform not in BUILT_IN.values())


async def resolve_platform(
    device: str, plugins: list[InstalledPlugin], loader: PluginLoader, *, chosen_by: str | None = None
) -> type[Platform]:
    """Resolve and install the platform. `plugins`: the allowed platform plugins. `chosen_by` names
    who fixed `device` (a child's frontend), which then skips the detectors that do not matter."""
    global _requested
    trace = loader.trace
    by_name = {plugin.name: plugin for plugin in plugins}
    started = time.time()
    _requested = None if device == "auto" else device  # before any detector runs: they may read it
    if device != "auto":
        why = f"chosen by {chosen_by}" if chosen_by else "named by --device"
        platform, key = await _named(device, by_name, loader, why), device
    else:
        why = "detected"
        platform, key = await _detect(by_name, loader)
    check_platform(platform)
    _check_cuda_is_usable(platform, key)
    set_current_platform(platform, key)
    trace.add(PHASE_PLATFORM, started=started, plugin=f"chosen: {platform.device_name}", reason=why)
    return platform


async def _named(device: str, by_name: dict[str, InstalledPlugin], loader: PluginLoader, why: str) -> type[Platform]:
    for name, other in by_name.items():
        if name != device:
            loader.skip(other, PHASE_PLATFORM, f"not asked for: device {device!r} was {why}")
    if device in BUILT_IN:
        return BUILT_IN[device]
    plugin = by_name.get(device)
    if plugin is None:
        known = ", ".join([*BUILT_IN, *by_name]) or "none"
        raise ConfigError(f"device {device!r} is not a known platform; known: {known}", field="device")
    path = await loader.load(plugin, PHASE_PLATFORM, call=True)
    if path is None or path is NOT_LOADED:
        raise StartupError(f"platform plugin {device!r} was named by --device but is not active here")
    return _import_platform(path, plugin)


async def _detect(by_name: dict[str, InstalledPlugin], loader: PluginLoader) -> tuple[type[Platform], str]:
    trace = loader.trace
    active: list[tuple[InstalledPlugin, str]] = []
    for plugin in by_name.values():
        path = await loader.load(plugin, PHASE_PLATFORM, call=True)
        if path is NOT_LOADED:
            continue  # it failed and the engine runs leniently: its record says so
        trace.records[-1].reason = f"active: {path}" if path else "inactive (returned None)"
        if path is not None:
            active.append((plugin, path))
    if len(active) > 1:
        names = " and ".join(f"{p.name!r} ({path})" for p, path in active)
        raise StartupError(
            f"two or more out-of-tree platforms are active: {names}; choose one with --device NAME"
        )
    if active:
        plugin, path = active[0]
        trace.add(PHASE_PLATFORM, started=time.time(), plugin="detector:cuda", outcome=SKIPPED,
                  reason=f"out-of-tree platform {plugin.name!r} is active and wins over the built-ins")
        return _import_platform(path, plugin), plugin.name
    started = time.time()
    try:
        usable = CudaPlatform.is_available()
    except Exception as exc:  # a detector that raises is an error, not a silent fallback to cpu
        trace.add(PHASE_PLATFORM, started=started, plugin="detector:cuda", outcome=FAILED, reason=format_failure(exc))
        raise StartupError(f"the cuda detector raised {type(exc).__name__}: {exc}") from exc
    trace.add(PHASE_PLATFORM, started=started, plugin="detector:cuda", outcome=OK,
              reason="a GPU is usable" if usable else "no usable GPU")
    return (CudaPlatform, "cuda") if usable else (CpuPlatform, "cpu")


def _import_platform(path: str, plugin: InstalledPlugin) -> type[Platform]:
    from asyncengine.interfaces.imports import import_by_path

    if not isinstance(path, str):
        raise StartupError(f"{plugin.label} returned {path!r}; a platform plugin returns a 'package.module:Class' "
                           "(or 'package.module.Class') path, or None")
    try:
        return import_by_path(path, what=f"platform of {plugin.label}", error=StartupError)
    except Exception as exc:  # named with the plugin that pointed there
        raise StartupError(f"{plugin.label}: cannot import its platform {path!r}: {exc}") from exc


def _check_cuda_is_usable(platform: type[Platform], key: str) -> None:
    """A CUDA platform (the built-in one, or a plugin's subclass of CudaPlatform, as vLLM's are) on a host
    where torch sees no CUDA device fails here, saying so, rather than with torch's words from the first
    tensor a worker puts on the device."""
    if not issubclass(platform, CudaPlatform):
        return
    try:
        usable = CudaPlatform.is_available()
    except Exception as exc:  # torch's own failure to ask (a broken driver): named, as the detector's is
        raise StartupError(f"platform {key!r} ({platform.__module__}.{platform.__qualname__}) is a CudaPlatform, "
                           f"and asking torch for a CUDA device raised {type(exc).__name__}: {exc}") from exc
    if not usable:
        what = ("the built-in CUDA platform" if platform is CudaPlatform else
                f"platform {key!r} ({platform.__module__}.{platform.__qualname__}) subclasses CudaPlatform, so it")
        raise StartupError(f"{what} needs a CUDA device, and this host has none that torch can use "
                           "(torch.cuda.is_available() is False): run it on a CUDA host, choose another platform "
                           "with --device (cpu), or, for a platform plugin that runs on the CPU, subclass "
                           "CpuPlatform instead")


def check_platform(platform: object) -> None:
    if not isinstance(platform, type) or not issubclass(platform, Platform):
        raise StartupError(f"{platform!r} is not a subclass of asyncengine.plugins_api.Platform")
    for attribute in Platform.REQUIRED_ATTRIBUTES:
        if not getattr(platform, attribute, None):
            raise StartupError(f"platform {platform.__name__} lacks {attribute!r}: set it on the class")
    for hook in Platform.REQUIRED_HOOKS:
        if not callable(getattr(platform, hook, None)):
            raise StartupError(f"platform {platform.__name__} lacks the hook {hook!r} (it must be callable)")
