"""Loading one plugin: import its entry point, call it when its group calls for that, check the result.

Imports and sync callables run in a thread (a plugin's import may take seconds; the event loop must
not stop); async callables run on the loop. Both are bounded by `plugin_startup_timeout`. While a
plugin's code runs, registries attribute what it registers to it. Every outcome is a record; a
failure raises PhaseFailure naming the plugin, its group, the process and the phase (unless the
engine runs with `plugins_lenient`, which records and goes on).
"""

from __future__ import annotations

import contextvars
import inspect
import time
from typing import Any

import anyio

from asyncengine.plugin_runtime.discovery import InstalledPlugin
from asyncengine.plugin_runtime.records import FAILED, OK, SKIPPED, PhaseFailure, StartupTrace, format_failure
from asyncengine.interfaces.registry import current_registrant


# What `load` returns for a plugin that failed while the engine runs with plugins_lenient.
NOT_LOADED: Any = type("NotLoaded", (), {"__repr__": lambda self: "NOT_LOADED"})()


class PluginLoader:
    def __init__(self, trace: StartupTrace, *, timeout: float, lenient: bool) -> None:
        self.trace = trace
        self.timeout = timeout
        self.lenient = lenient

    def skip(self, plugin: InstalledPlugin, phase: str, reason: str) -> None:
        self.trace.add(phase, started=time.time(), outcome=SKIPPED, reason=reason, **_about(plugin))

    async def load(self, plugin: InstalledPlugin, phase: str, *, call: bool) -> Any:
        """The entry point's object (or, with `call`, what calling it returned); NOT_LOADED if it failed
        leniently."""
        started = time.time()
        registrant = f"plugin {plugin.name!r}" + (f" ({plugin.distribution})" if plugin.distribution else "")
        import_seconds = 0.0
        with anyio.move_on_after(self.timeout) as deadline:
            try:
                loaded, import_seconds = await anyio.to_thread.run_sync(_timed_import, plugin, abandon_on_cancel=True)
            except Exception as exc:  # the plugin's own failure: recorded with its traceback, named in the error
                return self._failed(plugin, phase, started, f"failed to import: {type(exc).__name__}: {exc}", exc)
            if not call:
                result = loaded
            else:
                try:
                    result = await _call_as(registrant, loaded)
                except Exception as exc:  # as above: the plugin raised
                    return self._failed(plugin, phase, started, f"raised when called: {type(exc).__name__}: {exc}", exc)
        if deadline.cancelled_caught:
            problem = f"did not finish within {self.timeout:g} s (plugin_startup_timeout)"
            return self._failed(plugin, phase, started, problem, TimeoutError(problem))
        self.trace.add(phase, started=started, outcome=OK, import_duration=import_seconds, **_about(plugin))
        return result

    def _failed(self, plugin: InstalledPlugin, phase: str, started: float, what: str, exc: BaseException) -> Any:
        detail = what if isinstance(exc, TimeoutError) else format_failure(exc)
        self.trace.add(phase, started=started, outcome=FAILED, reason=detail, **_about(plugin))
        message = (
            f"{self.trace.process} failed in start-up phase {phase!r}: {plugin.label} {what}"
        )
        if self.lenient:
            return NOT_LOADED
        raise PhaseFailure(message, phase=phase, original=exc)

    def reject(self, plugin: InstalledPlugin, phase: str, problem: str) -> None:
        """A plugin loaded but gave something its group cannot use."""
        self.trace.records.pop()  # replace its "ok" record
        self._failed(plugin, phase, time.time(), problem, TypeError(problem))


def _timed_import(plugin: InstalledPlugin) -> tuple[Any, float]:
    """The entry point's object, and the seconds its import took (timed in the thread that imports)."""
    started = time.perf_counter()
    loaded = plugin.entry_point.load()
    return loaded, time.perf_counter() - started


async def _call_as(registrant: str, function: Any) -> Any:
    """Call a plugin's callable (sync in a thread, async on the loop) with registrations attributed to it."""
    if not callable(function):
        raise TypeError(f"the entry point is {type(function).__name__}, not a callable")
    if inspect.iscoroutinefunction(function):
        return await _await_as(registrant, function())

    def run_sync() -> Any:
        context = contextvars.copy_context()  # a thread's context of its own, whatever the thread pool does
        context.run(current_registrant.set, registrant)
        return context.run(function)

    result = await anyio.to_thread.run_sync(run_sync, abandon_on_cancel=True)
    if inspect.isawaitable(result):  # a sync callable that returned a coroutine
        return await _await_as(registrant, result)
    return result


async def _await_as(registrant: str, awaitable: Any) -> Any:
    token = current_registrant.set(registrant)
    try:
        return await awaitable
    finally:
        current_registrant.reset(token)


def _about(plugin: InstalledPlugin) -> dict[str, Any]:
    return {
        "group": plugin.group.entry_point_group,
        "plugin": plugin.name,
        "distribution": plugin.distribution,
        "version": plugin.version,
    }
