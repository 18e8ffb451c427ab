"""vLLM's helpers that plugin tests call: `load_general_plugins()`, `load_stat_logger_plugin_factories()`,
`load_endpoint_plugins()` and `envs`.

`load_general_plugins()` runs the general-plugins phase of this process on its own, as vLLM's does for
a test that registers models without starting an engine; a plugin already loaded in this process is
not called again (the engine's phases share that memory). It honours the allow-list
(ASYNCENGINE_PLUGINS) and is strict as the engine is: a failing plugin raises, naming itself.

`envs` answers the few vLLM environment flags a plugin branches on, with the value they have here.
"""

from __future__ import annotations

import os
from typing import Any


def load_general_plugins(plugins: str | None = None) -> list[str]:
    """Load (and call) every allowed general plugin once in this process; the names loaded, in order.
    `plugins`: an allow-list as `--plugins` takes it (None: ASYNCENGINE_PLUGINS, else all)."""
    import anyio
    import sniffio

    try:
        sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return anyio.run(_load_general_plugins, plugins)
    raise RuntimeError("load_general_plugins() is synchronous and was called inside an event loop: "
                       "await aload_general_plugins() there instead")


async def aload_general_plugins(plugins: str | None = None) -> list[str]:
    """`load_general_plugins` for a caller inside an event loop."""
    return await _load_general_plugins(plugins)


async def _load_general_plugins(plugins: str | None) -> list[str]:
    from asyncengine.plugin_runtime import groups as g
    from asyncengine.plugin_runtime.allow_list import AllowList
    from asyncengine.plugin_runtime.discovery import installed_plugins
    from asyncengine.plugin_runtime.loader import PluginLoader
    from asyncengine.plugin_runtime.phases import PluginState, _load_once
    from asyncengine.plugin_runtime.records import StartupTrace

    installed = installed_plugins()
    allow_list = AllowList.resolve(plugins)
    allow_list.check(installed)
    trace = StartupTrace("frontend")
    loader = PluginLoader(trace, timeout=60.0, lenient=False)
    # Only the general plugins run here (vLLM's load_general_plugins): no platform and no config exist yet.
    state = PluginState(platform=None, allow_list=allow_list, config=None)  # type: ignore[arg-type]
    names = []
    async with trace.phase(g.PHASE_GENERAL):
        for plugin in installed:
            if plugin.group is g.GENERAL and allow_list.verdict(plugin) is None:
                await _load_once(plugin, g.PHASE_GENERAL, loader, state, call=True)
                names.append(plugin.name)
    return names


def load_stat_logger_plugin_factories(plugins: str | None = None) -> list[type]:
    """vLLM's: the stat-logger classes of the allowed stat-logger plugins, in order, loaded in this
    process without starting an engine. One that is no StatLoggerBase subclass is a TypeError naming it."""
    import anyio
    import sniffio

    try:
        sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return anyio.run(_load_stat_logger_classes, plugins)
    raise RuntimeError("load_stat_logger_plugin_factories() is synchronous and was called inside an event loop")


async def _load_stat_logger_classes(plugins: str | None) -> list[type]:
    from asyncengine.interfaces.stat_logger import StatLoggerBase
    from asyncengine.plugin_runtime import groups as g
    from asyncengine.plugin_runtime.allow_list import AllowList
    from asyncengine.plugin_runtime.discovery import installed_plugins
    from asyncengine.plugin_runtime.loader import NOT_LOADED, PluginLoader
    from asyncengine.plugin_runtime.records import StartupTrace

    installed = installed_plugins()
    allow_list = AllowList.resolve(plugins)
    allow_list.check(installed)
    loader = PluginLoader(StartupTrace("frontend"), timeout=60.0, lenient=False)
    factories: list[type] = []
    for plugin in installed:
        if plugin.group is g.STAT_LOGGER and allow_list.verdict(plugin) is None:
            cls = await loader.load(plugin, g.PHASE_ROLE_GROUPS, call=False)  # the entry point names the class
            if cls is NOT_LOADED:
                continue
            if not (isinstance(cls, type) and issubclass(cls, StatLoggerBase)):
                raise TypeError(f"Stat logger plugin {plugin.name!r} must be a subclass of StatLoggerBase, "
                                f"got {cls!r} ({plugin.label})")
            factories.append(cls)
    return factories


def load_endpoint_plugins(supported_tasks: tuple[str, ...] | None = None, plugins: str | None = None) -> list[Any]:
    """vLLM's: the allowed endpoint plugins' objects (each entry point called), loaded without a server,
    leaving out those whose `required_tasks` meet none of `supported_tasks` (None: only those that
    require nothing), as vLLM's function does. A server refuses such a plugin at start-up instead."""
    import anyio
    import sniffio

    try:
        sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return anyio.run(_load_endpoint_objects, supported_tasks, plugins)
    raise RuntimeError("load_endpoint_plugins() is synchronous and was called inside an event loop")


async def _load_endpoint_objects(supported_tasks: tuple[str, ...] | None, plugins: str | None) -> list[Any]:
    from asyncengine.plugin_runtime import groups as g
    from asyncengine.plugin_runtime.allow_list import AllowList
    from asyncengine.plugin_runtime.discovery import installed_plugins
    from asyncengine.plugin_runtime.loader import NOT_LOADED, PluginLoader
    from asyncengine.plugin_runtime.records import StartupTrace

    installed = installed_plugins()
    allow_list = AllowList.resolve(plugins)
    allow_list.check(installed)
    loader = PluginLoader(StartupTrace("frontend"), timeout=60.0, lenient=False)
    found = []
    for plugin in installed:
        if plugin.group is g.ENDPOINT and allow_list.verdict(plugin) is None:
            endpoint = await loader.load(plugin, g.PHASE_ROLE_GROUPS, call=True)  # a class or factory: called
            if endpoint is NOT_LOADED:
                continue
            required = getattr(endpoint, "required_tasks", None)
            if required is None or set(required) & set(supported_tasks or ()):
                found.append(endpoint)
    return found


class _Envs:
    """vLLM's `envs` module, for the flags a plugin branches on. VLLM_USE_V1 is true (this engine's
    design is vLLM's v1); VLLM_PLUGINS reads ASYNCENGINE_PLUGINS. Any other name is an AttributeError
    saying so, rather than a guess."""

    VLLM_USE_V1 = True
    VLLM_ENABLE_V1_MULTIPROCESSING = True

    @property
    def VLLM_PLUGINS(self) -> list[str] | None:
        value = os.environ.get("ASYNCENGINE_PLUGINS")
        return None if value is None else [name.strip() for name in value.split(",")]

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"envs.{name}: asyncengine has no counterpart of vLLM's {name} "
                             "(docs/porting.md, 'Environment variables'); read os.environ, or use an option")


envs = _Envs()
