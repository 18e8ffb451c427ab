"""`asyncengine plugins check` in the engine core: its workers' start-up phases, without a model.

Serving builds the executor, loads the model and allocates the KV cache (core.py). A check only has
the workers run their plugin phases where they would run: with the worker in this process (`uni`, or an
executor placed as `uni`) they ran with this process's own; with worker processes each rank runs
its own (manifest check included), says Ready and exits. No executor is built, no device touched.
"""

from __future__ import annotations

from typing import Any

from asyncengine.config.engine import EngineConfig
from asyncengine.engine_core.worker_processes import WorkerProcesses
from asyncengine.plugin_runtime.platform_resolution import current_platform_key
from asyncengine.plugin_runtime.placement import worker_in_engine_core
from asyncengine.plugin_runtime.records import StartupTrace
from asyncengine.wire.messages import CheckParams


async def check_workers(engine_config: EngineConfig, trace: StartupTrace, frontend_manifest: Any = None) -> None:
    """The `start workers` phase of a check; a rank that fails raises its error, named."""
    if worker_in_engine_core(engine_config):
        async with trace.phase("start workers"):
            return  # this process played the worker role: its phases are in `trace` already
    world_size = engine_config.world_size
    workers = WorkerProcesses()
    try:
        async with trace.phase("start workers"):
            await workers.start(world_size, lambda rank: CheckParams(
                engine_config=engine_config, platform=current_platform_key(), manifest=frontend_manifest,
                rank=rank, world_size=world_size,
            ), trace)
    finally:
        await workers.stop(grace_period=5.0)  # a checked worker exits once it has said Ready
