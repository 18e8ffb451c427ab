"""A worker process (`python -m asyncengine.worker.process`): one tensor-parallel rank.

Start-up: hand-shake, then `init device` (joins the process group when there are several ranks).
Then it serves the engine core's messages in order: steps and method calls, each run in a thread so
the event loop keeps reading its connection.
"""

from __future__ import annotations

import traceback

import anyio

from asyncengine.errors import error_type_name
from asyncengine.runtime.child import child_main, run_phase
from asyncengine.wire.framing import FrameStream
from asyncengine.wire.messages import (
    ExecuteModel,
    Ready,
    Shutdown,
    StartupParams,
    StepResult,
    WorkerCall,
    WorkerCallResult,
    WorkerInbox,
)


async def serve_worker(frames: FrameStream, params: StartupParams) -> None:
    from asyncengine.worker.worker import Worker

    worker = Worker(
        params.engine_config, params.model_config, params.device, rank=params.rank,
        world_size=params.world_size, distributed_init_method=params.distributed_init_method,
    )
    await run_phase("init device", lambda: anyio.to_thread.run_sync(worker.init_device))
    await frames.send(Ready(info={"rank": params.rank}))
    while True:
        message = await frames.receive()
        if isinstance(message, ExecuteModel):
            try:
                output = await anyio.to_thread.run_sync(worker.execute_model, message.scheduler_output)
            except Exception as exc:  # the engine core names this rank and fails every request
                await frames.send(StepResult(error=_summary(exc)))
                raise
            await frames.send(StepResult(output=output))
        elif isinstance(message, WorkerCall):
            try:
                method = getattr(worker, message.method)
                result = await anyio.to_thread.run_sync(lambda: method(*message.args))
            except Exception as exc:  # the caller gets the error with this rank's name
                await frames.send(
                    WorkerCallResult(call_id=message.call_id, error=_summary(exc), error_type=error_type_name(exc))
                )
            else:
                await frames.send(WorkerCallResult(call_id=message.call_id, result=result))
        elif isinstance(message, Shutdown):
            await anyio.to_thread.run_sync(worker.shutdown)
            return


def _summary(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


if __name__ == "__main__":
    raise SystemExit(child_main("worker", WorkerInbox, serve_worker))
