"""vLLM's helpers that plugin tests call: `load_general_plugins()`, `load_stat_logger_plugin_factories()`,
`load_endpoint_plugins()` and `load_plugins_by_group()` (which vLLM's tests stub); `envs` is
asyncengine/compat/envs.py.

`load_general_plugins()` runs the general-plugins phase of this process on its own, as vLLM's does for
a test that registers models without starting an engine; a plugin already loaded in this process is
not called again (the engine's phases share that memory). It honours the allow-list
(ASYNCENGINE_PLUGINS) and is strict as the engine is: a failing plugin raises, naming itself.
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


def load_plugins_by_group(group: str) -> dict[str, Any]:
    """vLLM's: the allowed plugins of the entry-point group `group` ("asyncengine.stat_logger_plugins"),
    by entry-point name, each entry point loaded and not called. Strict as the engine is: one that
    fails to import raises, naming it.

    vLLM's tests stub this function (`monkeypatch.setattr("vllm.plugins.load_plugins_by_group", fake)`,
    which `plugins port` rewrites to this module's name): the loaders below look it up in this module
    when they are called, so such a stub takes effect as it does in vLLM."""
    return _loaded_by_group(group, None)


def _plugins_of(group: Any, plugins: str | None) -> dict[str, Any]:
    """The group's allowed plugins, loaded: through `load_plugins_by_group` (a stub included) unless the
    caller gave an allow-list of its own, which vLLM's one-argument function cannot take."""
    if plugins is None:
        return load_plugins_by_group(group.entry_point_group)  # looked up now: a monkeypatched stub wins
    return _loaded_by_group(group.entry_point_group, plugins)


def _loaded_by_group(group_name: str, plugins: str | None) -> dict[str, Any]:
    from asyncengine.plugin_runtime import groups as g

    group = g.BY_ENTRY_POINT_GROUP.get(group_name)
    if group is None:
        raise ValueError(f"{group_name!r} is not an entry-point group of asyncengine's; the groups: "
                         f"{', '.join(g.BY_ENTRY_POINT_GROUP)}")
    return _run_outside_a_loop("load_plugins_by_group", _load_group, group, plugins)


async def _load_group(group: Any, plugins: str | None) -> dict[str, Any]:
    from asyncengine.plugin_runtime.allow_list import AllowList
    from asyncengine.plugin_runtime.discovery import installed_plugins
    from asyncengine.plugin_runtime.loader import NOT_LOADED, PluginLoader
    from asyncengine.plugin_runtime.records import StartupTrace

    installed = installed_plugins()
    allow_list = AllowList.resolve(plugins)
    allow_list.check(installed)
    loader = PluginLoader(StartupTrace("frontend"), timeout=60.0, lenient=False)
    loaded: dict[str, Any] = {}
    for plugin in installed:
        # The allow-list as vLLM's function applies it: unset loads all (opt-in groups are gated by
        # their own loader, as load_endpoint_plugins is), a list loads the names it has.
        if plugin.group is group and (allow_list.names is None or plugin.name in allow_list.names):
            value = await loader.load(plugin, group.phase, call=False)  # the entry point's object, not called
            if value is not NOT_LOADED:
                loaded[plugin.name] = value
    return loaded


def _run_outside_a_loop(name: str, function: Any, *args: Any) -> Any:
    import anyio
    import sniffio

    try:
        sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return anyio.run(function, *args)
    raise RuntimeError(f"{name}() is synchronous and was called inside an event loop")


def load_stat_logger_plugin_factories(plugins: str | None = None) -> list[type]:
    """vLLM's: the stat-logger classes of the allowed stat-logger plugins, in order, loaded in this
    process without starting an engine. One that is no StatLoggerBase subclass is a TypeError naming it.
    `plugins`: an allow-list as `--plugins` takes it (None: ASYNCENGINE_PLUGINS, else all)."""
    from asyncengine.interfaces.stat_logger import StatLoggerBase
    from asyncengine.plugin_runtime import groups as g

    factories: list[type] = []
    for name, cls in _plugins_of(g.STAT_LOGGER, plugins).items():
        if not (isinstance(cls, type) and issubclass(cls, StatLoggerBase)):
            raise TypeError(f"Stat logger plugin {name!r} must be a subclass of StatLoggerBase, got {cls!r} "
                            f"(entry point {name!r} of {g.STAT_LOGGER.entry_point_group})")
        factories.append(cls)
    return factories


def load_endpoint_plugins(supported_tasks: tuple[str, ...] | None = None, plugins: str | None = None) -> list[Any]:
    """vLLM's: the allowed endpoint plugins' objects (each entry point called), loaded without a server,
    leaving out those whose `required_tasks` meet none of `supported_tasks` (None: only those that
    require nothing), as vLLM's function does. Opt-in: with no allow-list, none (and nothing is loaded).
    A factory that raises is an error naming the plugin (strict; vLLM logs it and goes on). A server
    refuses a plugin whose required_tasks it does not serve at start-up instead."""
    from asyncengine.plugin_runtime import groups as g
    from asyncengine.plugin_runtime.allow_list import ENV_VAR
    from asyncengine.errors import StartupError

    if plugins is None and ENV_VAR not in os.environ:
        return []  # as vLLM's: the loader is not even called
    found = []
    for name, factory in _plugins_of(g.ENDPOINT, plugins).items():
        try:
            endpoint = factory()  # a class or factory: called
        except Exception as exc:  # strict, as the engine is: named, never skipped
            raise StartupError(f"endpoint plugin {name!r} ({g.ENDPOINT.entry_point_group}): its factory "
                              f"raised {type(exc).__name__}: {exc}") from exc
        required = getattr(endpoint, "required_tasks", None)
        if required is None or set(required) & set(supported_tasks or ()):
            found.append(endpoint)
    return found
