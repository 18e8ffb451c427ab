"""The plugin phases every process runs at start-up, in order, each one traced:

1. platform (the platform plugins' detectors and the built-ins), 2. general plugins, 3. role groups
(the groups this process's roles load), 4. config hooks (every `module:attr` the config names that
this process reads, imported and type-checked), 5. manifest check (children only).

A process may play several roles: in-process, the frontend is also the engine core (and, with `uni`,
the worker). General plugins load once per process: a second engine started in the same process
reuses what the first loaded (registrations are process-wide), and its records say so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from asyncengine.config.engine import EngineConfig
from asyncengine.errors import ConfigError, ModelLoadError
from asyncengine.interfaces.imports import import_by_path
from asyncengine.plugin_runtime import groups as g
from asyncengine.plugin_runtime.allow_list import AllowList
from asyncengine.plugin_runtime.discovery import InstalledPlugin, installed_plugins
from asyncengine.plugin_runtime.loader import NOT_LOADED, PluginLoader
from asyncengine.wire.startup import Manifest, PluginInfo
from asyncengine.plugin_runtime.manifest import build_manifest, check_manifest
from asyncengine.plugin_runtime.records import StartupTrace
from asyncengine.interfaces.platform import Platform
from asyncengine.plugin_runtime.platform_resolution import resolve_platform
from asyncengine.interfaces.registry import describe, reads

# (group, name) -> what loading returned, for plugins already loaded in this process.
_loaded_in_process: dict[tuple[str, str], Any] = {}


@dataclass
class PluginState:
    """What the plugin phases produced in one process."""

    platform: type[Platform]
    allow_list: AllowList
    config: EngineConfig
    loaded: list[PluginInfo] = field(default_factory=list)
    io_processors: dict[str, type] = field(default_factory=dict)
    stat_loggers: list[type] = field(default_factory=list)
    endpoints: list[Any] = field(default_factory=list)
    logits_processors: list[type] = field(default_factory=list)
    manifest: Manifest | None = None
    owners: dict[Any, str] = field(default_factory=dict)  # a kept class -> the plugin it came from, for errors


async def run_plugin_phases(
    roles: set[str],
    config: EngineConfig,
    trace: StartupTrace,
    *,
    device: str | None = None,
    device_chosen_by: str | None = None,
    frontend_manifest: Manifest | None = None,
    endpoint_tasks: tuple[str, ...] | None = None,
) -> PluginState:
    """Run phases 1-4 (and 5 when `frontend_manifest` is given) for a process playing `roles`;
    `endpoint_tasks`: what the server serves when not the runner's tasks (the render server's)."""
    started = time.time()
    installed = installed_plugins()
    allow_list = AllowList.resolve(config.plugins)
    allow_list.check(installed)
    trace.add(g.PHASE_PLATFORM, started=started, plugin="entry points",
              reason=f"{len(installed)} installed in the six groups")
    loader = PluginLoader(trace, timeout=config.plugin_startup_timeout, lenient=config.plugins_lenient)
    allowed, skipped = _sort_out(installed, allow_list, roles)

    async with trace.phase(g.PHASE_PLATFORM):
        _record_skipped(skipped, g.PLATFORM, loader)
        platform = await resolve_platform(
            device or config.device, allowed[g.PLATFORM.key], loader, chosen_by=device_chosen_by
        )
        if device_chosen_by is None:  # the process that chooses also lets the platform adjust the config
            config = _updated_by_platform(config, platform, trace)
    state = PluginState(platform=platform, allow_list=allow_list, config=config)

    async with trace.phase(g.PHASE_GENERAL):
        _record_skipped(skipped, g.GENERAL, loader)
        for plugin in allowed[g.GENERAL.key]:
            await _load_once(plugin, g.PHASE_GENERAL, loader, state, call=True)

    async with trace.phase(g.PHASE_ROLE_GROUPS):
        for group in (g.IO_PROCESSOR, g.STAT_LOGGER, g.ENDPOINT, g.LOGITS_PROCESSOR):
            _record_skipped(skipped, group, loader)
            for plugin in allowed[group.key]:
                calls = group in (g.IO_PROCESSOR, g.ENDPOINT)  # the others name a class
                result = await _load_once(plugin, g.PHASE_ROLE_GROUPS, loader, state, call=calls)
                if result is not None:
                    _keep(state, plugin, result, loader)
        if g.FRONTEND in roles:  # what would fail only at the first request fails here, naming the plugin
            from asyncengine.plugin_runtime.contracts import check_frontend_contracts

            check_frontend_contracts(state.stat_loggers, state.endpoints, config, state.owners, endpoint_tasks)

    async with trace.phase(g.PHASE_CONFIG_HOOKS):
        from asyncengine.plugin_runtime.config_hooks import check_config_hooks

        # In a thread, as plugin imports are: importing a user's module may take seconds.
        await anyio.to_thread.run_sync(check_config_hooks, config, roles, trace)
        if g.FRONTEND in roles:  # additional_config: every key claimed by the platform or a plugin
            from asyncengine.plugin_runtime.additional_config import check_additional_config

            await anyio.to_thread.run_sync(check_additional_config, config, platform, trace)
        speculative = config.speculative
        if g.FRONTEND in roles and speculative is not None:  # the method's name, now that plugins have registered
            from asyncengine.interfaces.spec_decode import ProposerRegistry

            ProposerRegistry.check_method(speculative)
        if roles & g.LOGITS_PROCESSOR.roles and config.logits_processors:
            state.logits_processors = _with_configured_logits_processors(state.logits_processors, config)
        if g.WORKER in roles:  # attention backends and out-of-tree ops: found at start-up, not at the first step
            from asyncengine.plugin_runtime.contracts import check_worker_contracts

            await anyio.to_thread.run_sync(check_worker_contracts, platform, config)

    state.manifest = build_manifest(trace.process, state.loaded)
    if frontend_manifest is not None:
        async with trace.phase(g.PHASE_MANIFEST):
            check_manifest(frontend_manifest, roles, trace)
    return state


async def resolve_platform_only(config: EngineConfig, trace: StartupTrace) -> type[Platform]:
    """Just the platform phase (the CLI runs it before parsing, so the platform can add options)."""
    installed = installed_plugins()
    allow_list = AllowList.resolve(config.plugins)
    allow_list.check(installed)
    loader = PluginLoader(trace, timeout=config.plugin_startup_timeout, lenient=config.plugins_lenient)
    platforms = [p for p in installed if p.group is g.PLATFORM and allow_list.verdict(p) is None]
    async with trace.phase(g.PHASE_PLATFORM):
        return await resolve_platform(config.device, platforms, loader)


Skipped = dict[str, list[tuple[InstalledPlugin, str]]]


def _sort_out(installed: list[InstalledPlugin], allow_list: AllowList,
              roles: set[str]) -> tuple[dict[str, list[InstalledPlugin]], Skipped]:
    """Per group this process loads: the plugins that may load, and the others with the reason."""
    allowed: dict[str, list[InstalledPlugin]] = {group.key: [] for group in g.GROUPS}
    skipped: Skipped = {group.key: [] for group in g.GROUPS}
    for plugin in installed:
        if not roles & plugin.group.roles:
            continue
        reason = allow_list.verdict(plugin)
        if reason is None:
            allowed[plugin.group.key].append(plugin)
        else:
            skipped[plugin.group.key].append((plugin, reason))
    return allowed, skipped


def _record_skipped(skipped: Skipped, group: g.Group, loader: PluginLoader) -> None:
    for plugin, reason in skipped[group.key]:
        loader.skip(plugin, group.phase, reason)


async def _load_once(plugin: InstalledPlugin, phase: str, loader: PluginLoader, state: PluginState, *, call: bool) -> Any:
    key = (plugin.group.key, plugin.name)
    if key in _loaded_in_process:
        loader.trace.add(phase, started=time.time(), reason="already loaded in this process",
                         group=plugin.group.entry_point_group, plugin=plugin.name,
                         distribution=plugin.distribution, version=plugin.version)
        result = _loaded_in_process[key]
    else:
        result = await loader.load(plugin, phase, call=call)
        if result is NOT_LOADED:
            return None
        _loaded_in_process[key] = result
    state.loaded.append(PluginInfo(group=plugin.group.entry_point_group, name=plugin.name,
                                   distribution=plugin.distribution, version=plugin.version))
    return result


def _keep(state: PluginState, plugin: InstalledPlugin, result: Any, loader: PluginLoader) -> None:
    """Check what a role-group plugin gave and keep it for the engine."""
    from asyncengine.interfaces.endpoint import EndpointPlugin, is_router_form
    from asyncengine.interfaces.io_processor import IOProcessor
    from asyncengine.interfaces.logits import LogitsProcessor
    from asyncengine.interfaces.stat_logger import StatLoggerBase

    group = plugin.group
    if group is g.IO_PROCESSOR:
        cls = import_by_path(result, what=plugin.label, error=ModelLoadError) if isinstance(result, str) else result
        if _is_subclass(cls, IOProcessor):
            state.io_processors[plugin.name] = cls
            return
        problem = f"returned {result!r}, which is not an IOProcessor subclass (or its path)"
    elif group is g.STAT_LOGGER:
        if _is_subclass(result, StatLoggerBase):
            state.stat_loggers.append(result)
            state.owners[result] = f"{describe(result)} ({plugin.label})"
            return
        problem = f"names {result!r}, which is not a StatLoggerBase subclass"
    elif group is g.ENDPOINT:
        # Ours, or vLLM's form (attach_router: a FastAPI router, served by the server as an ASGI app).
        if (isinstance(result, EndpointPlugin) or is_router_form(result)) and getattr(result, "name", None):
            state.endpoints.append(result)
            state.owners[type(result)] = f"{describe(type(result))} ({plugin.label})"
            return
        problem = (f"returned {result!r}, which is not an EndpointPlugin with a name (nor vLLM's form: "
                   "a name and attach_router(app))")
    else:
        if _is_subclass(result, LogitsProcessor):
            state.logits_processors.append(result)
            return
        problem = f"names {result!r}, which is not a LogitsProcessor subclass"
    loader.reject(plugin, group.phase, problem)


@reads("hook:logits_processors", "frontend")  # to validate requests
@reads("hook:logits_processors", "worker")  # to build them
def _with_configured_logits_processors(from_entry_points: list[type], config: EngineConfig) -> list[type]:
    """Both doors (the asyncengine.logits_processors entry points and the `logits_processors` option) feed
    one list: entry points first (by name), then the option's classes in its order, each class once. The
    phase above checked every path already, so this only looks the classes up again (from the import cache)."""
    from asyncengine.plugin_runtime.config_hooks import load_hook

    configured = [load_hook(f"logits_processors[{index}]", path)
                  for index, path in enumerate(config.logits_processors or ())]
    return list(dict.fromkeys([*from_entry_points, *configured]))  # in order, each class once


def _is_subclass(value: Any, base: type) -> bool:
    return isinstance(value, type) and issubclass(value, base)


def _updated_by_platform(config: EngineConfig, platform: type[Platform], trace: StartupTrace) -> EngineConfig:
    """The platform's check_and_update_config: it may return the config (a changed copy, ours) or change
    it in place and return None (vLLM's). What it read or set that has no meaning here (through the
    vLLM-shaped views, asyncengine/config/vllm_views.py) is listed in the start-up report as ignored."""
    from asyncengine.config.vllm_views import collecting_ignored

    started = time.time()
    config = msgspec.structs.replace(config)  # the platform's own copy: the caller's config stays as it was
    from asyncengine.interfaces.plugin_code import plugin_hook

    with collecting_ignored() as ignored, plugin_hook(platform, "check_and_update_config"):
        returned = platform.check_and_update_config(config)
    for note in ignored:
        trace.add(g.PHASE_PLATFORM, started=started, plugin=f"platform {platform.device_name}: ignored",
                  reason=f"check_and_update_config: {note}")
    return _checked_config(config if returned is None else returned, platform)


def _checked_config(config: Any, platform: type[Platform]) -> EngineConfig:
    if not isinstance(config, EngineConfig):
        raise ConfigError(f"platform {platform.device_name}: check_and_update_config returned {config!r}, not an "
                          "EngineConfig (return the config, or change it in place and return None)")
    return msgspec.convert(msgspec.to_builtins(config), EngineConfig)  # re-validated after the platform's changes
