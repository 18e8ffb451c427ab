"""The engine-core process (`python -m asyncengine.engine_core.process`).

Start-up, in order: hand-shake; `engine core` (its executor starts the workers, which load the model
and allocate the KV cache); `ready`. Then the step loop serves the frontend over the same connection
until the frontend says Shutdown or goes away.
"""

from __future__ import annotations

import os

import anyio

from asyncengine.engine_core.core import EngineCore
from asyncengine.engine_core.loop import EngineCoreLoop
from asyncengine.runtime.child import child_main, run_phase
from asyncengine.wire.framing import FrameStream
from asyncengine.wire.messages import EngineCoreInbox, Ready, StartupParams


async def serve_engine_core(frames: FrameStream, params: StartupParams) -> None:
    name = f"the engine core (pid {os.getpid()})"
    async with anyio.create_task_group() as tg:
        core = await run_phase(
            "engine core",
            lambda: EngineCore.start(params.engine_config, params.model_config, params.device, tg, owner=name),
        )
        await frames.send(Ready(info={"num_blocks": core.num_blocks, "pid": os.getpid()}))
        loop = EngineCoreLoop(core, frames.send, process_name=name)
        await loop.serve(_messages(frames))
        tg.cancel_scope.cancel()


async def _messages(frames: FrameStream):
    while True:
        try:
            yield await frames.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return  # the frontend is gone: stop


if __name__ == "__main__":
    raise SystemExit(child_main("engine core", EngineCoreInbox, serve_engine_core))
