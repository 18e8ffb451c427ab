"""The engine-core process (`python -m asyncengine.engine_core.process`).

Start-up, in order: hand-shake; the plugin phases (platform, general plugins, role groups, config
hooks, manifest check); start workers (their own phases run in their processes); load model; KV
cache; ready. Then the step loop serves the frontend over the same connection until the frontend says
Shutdown or goes away. A `plugins check` start stops after the workers' checks, loading no model.
"""

from __future__ import annotations

import anyio

from asyncengine.engine_core.core import EngineCore
from asyncengine.engine_core.loop import EngineCoreLoop
from asyncengine.plugin_runtime.groups import ENGINE_CORE, WORKER
from asyncengine.plugin_runtime.phases import run_plugin_phases
from asyncengine.plugin_runtime.records import StartupTrace
from asyncengine.runtime.child import child_main
from asyncengine.wire.framing import FrameStream
from asyncengine.wire.messages import EngineCoreInbox, Ready, StartupParams


async def serve_engine_core(frames: FrameStream, params: StartupParams, trace: StartupTrace) -> None:
    config = params.engine_config
    roles = {ENGINE_CORE} | ({WORKER} if _worker_in_this_process(config) else set())
    state = await run_plugin_phases(roles, config, trace, device=params.platform, device_chosen_by="the frontend",
                                    frontend_manifest=params.manifest)
    async with anyio.create_task_group() as tg:
        core = await EngineCore.start(config, params.model_config, state, tg, trace=trace,
                                      frontend_manifest=params.manifest)
        async with trace.phase("ready"):
            pass
        await frames.send(Ready(info={"num_blocks": core.num_blocks if core else 0, "pid": trace.pid},
                                records=trace.records))
        trace.ready = True
        if core is None:  # a `plugins check` start: nothing to serve
            tg.cancel_scope.cancel()
            return
        loop = EngineCoreLoop(core, frames.send, process_name=trace.process)
        await loop.serve(_messages(frames))
        tg.cancel_scope.cancel()


def _worker_in_this_process(config) -> bool:
    from asyncengine.engine_core.executor import worker_placement

    return worker_placement(config) == "uni"


async def _messages(frames: FrameStream):
    while True:
        try:
            yield await frames.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return  # the frontend is gone: stop


if __name__ == "__main__":
    raise SystemExit(child_main("engine core", EngineCoreInbox, serve_engine_core))
