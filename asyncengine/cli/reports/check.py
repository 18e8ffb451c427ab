"""`asyncengine plugins check`: every role's start-up, without a model.

The frontend runs its plugin phases here; the engine core (in its own process unless in-process) and
the workers run theirs, manifest check included, and stop before loading anything.
"""

from __future__ import annotations

from asyncengine.config.engine import EngineConfig
from asyncengine.errors import ConfigError, StartupError
from asyncengine.frontend.core_client import check_engine_core
from asyncengine.plugin_runtime.phases import run_plugin_phases
from asyncengine.plugin_runtime.placement import frontend_roles
from asyncengine.wire.startup import StartupRecord
from asyncengine.plugin_runtime.records import StartupTrace


async def check_start(config: EngineConfig) -> tuple[list[StartupRecord], StartupError | None]:
    trace = StartupTrace("frontend")
    try:
        plugins = await run_plugin_phases(frontend_roles(config), config, trace)
        async with trace.phase("engine core"):
            await check_engine_core(plugins.config, plugins, trace)
    except ConfigError:
        raise  # unusable arguments: the CLI's exit code 2, not a failed check
    except StartupError as error:
        return trace.records, error
    return trace.records, None
