"""The engine-core process (`python -m asyncengine.engine_core.process`).

Start-up, in order: hand-shake; the plugin phases (platform, general plugins, role groups, config
hooks, manifest check); start workers (their own phases run in their processes); load model; KV
cache; ready. Then the step loop serves the frontend over the same connection until the frontend says
Shutdown or goes away. Sent CheckParams instead (`plugins check`), it runs the plugin phases and its
workers' (check.py), says Ready and exits, loading no model.
"""

from __future__ import annotations

import anyio

from asyncengine.engine_core.check import check_workers
from asyncengine.engine_core.core import run_engine_core
from asyncengine.engine_core.loop import EngineCoreLoop
from asyncengine.plugin_runtime.phases import run_plugin_phases
from asyncengine.plugin_runtime.placement import engine_core_roles
from asyncengine.plugin_runtime.records import StartupTrace
from asyncengine.runtime.child import child_main
from asyncengine.wire.framing import FrameStream
from asyncengine.wire.messages import CheckParams, EngineCoreInbox, Ready, StartupParams


async def serve_engine_core(frames: FrameStream, params: StartupParams, trace: StartupTrace) -> None:
    config = params.engine_config
    state = await run_plugin_phases(engine_core_roles(config), config, trace, device=params.platform,
                                    device_chosen_by="the frontend", frontend_manifest=params.manifest)
    async with anyio.create_task_group() as tg:
        core = await tg.start(run_engine_core, config, params.model_config, state, trace, params.manifest)
        async with trace.phase("ready"):
            pass
        await frames.send(Ready(info={"num_blocks": core.num_blocks, "pid": trace.pid}, records=trace.records))
        trace.ready = True
        # The loop shuts the executor down as it ends, and with it run_engine_core's task.
        await EngineCoreLoop(core, frames.send, process_name=trace.process).serve(_messages(frames))


async def check_engine_core(frames: FrameStream, params: CheckParams, trace: StartupTrace) -> None:
    config = params.engine_config
    await run_plugin_phases(engine_core_roles(config), config, trace, device=params.platform, device_chosen_by="the frontend",
                            frontend_manifest=params.manifest)
    await check_workers(config, trace, params.manifest)
    async with trace.phase("ready"):
        pass
    await frames.send(Ready(info={"num_blocks": 0, "pid": trace.pid}, records=trace.records))
    trace.ready = True



async def _messages(frames: FrameStream):
    while True:
        try:
            yield await frames.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return  # the frontend is gone: stop


if __name__ == "__main__":
    raise SystemExit(child_main("engine core", EngineCoreInbox, serve_engine_core, StartupTrace, check=check_engine_core))
