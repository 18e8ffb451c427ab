"""What every child process (engine core, worker) does around its role's work.

It exits when its parent dies, leaves Ctrl-C to the parent (a terminal sends SIGINT to the whole
process group; the parent decides how to stop), treats SIGTERM as "stop now", connects back with the
secret, receives its StartupParams, runs its start-up phases (recorded in its StartupTrace), and
reports Ready or, naming the phase that failed, StartupFailed, with its records either way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from asyncengine.errors import AsyncEngineError, error_field, error_type_name
from asyncengine.plugin_runtime.records import PhaseFailure, StartupTrace, name_the_phase
from asyncengine.runtime.connection import connect_to_parent
from asyncengine.runtime.groups import single_exceptions
from asyncengine.runtime.signals import ignore_interrupts, stop_now_on_sigterm
from asyncengine.runtime.spawn import ENV_ADDRESS, ENV_RANK, ENV_SECRET, die_with_parent
from asyncengine.wire.framing import FrameStream
from asyncengine.wire.messages import StartupFailed, StartupParams

logger = logging.getLogger(__name__)

Body = Callable[[FrameStream, StartupParams, StartupTrace], Awaitable[None]]


def child_main(role: str, inbox_type: Any, body: Body) -> int:
    """Entry point of a child process: returns its exit code. `role` is "engine core" or "worker"."""
    die_with_parent()
    ignore_interrupts()
    logging.basicConfig(level=os.environ.get("ASYNCENGINE_LOG_LEVEL", "WARNING").upper(),
                        format=f"%(levelname)s {role} %(name)s: %(message)s")
    address, secret = os.environ[ENV_ADDRESS], os.environ[ENV_SECRET]
    rank = int(os.environ.get(ENV_RANK, "0"))
    trace = StartupTrace(f"worker rank {rank}" if role == "worker" else role)

    async def main() -> int:
        async with anyio.create_task_group() as tg:
            await tg.start(stop_now_on_sigterm, tg.cancel_scope)
            frames = await connect_to_parent(address, secret, inbox_type, role=role, rank=rank)
            try:
                params = await frames.receive()
                if not isinstance(params, StartupParams):
                    raise PhaseFailure(f"expected StartupParams, got {type(params).__name__}", phase="hand-shake")
                with single_exceptions():  # the body's own task group wraps even one failure in a group
                    await body(frames, params, trace)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                tg.cancel_scope.cancel()  # the parent went away: nothing left to serve
                return 0
            except Exception as exc:  # reported to the parent, with the phase, the error and the records
                logger.error("%s", exc)
                if trace.ready:  # failed while serving: the parent learns it from the connection closing
                    tg.cancel_scope.cancel()
                    return 1
                phase = getattr(exc, "phase", None) or (trace.records[-1].phase if trace.records else "start-up")
                if not getattr(exc, "names_its_process", False):
                    exc = name_the_phase(trace.process, phase, exc)
                with anyio.move_on_after(5.0):
                    await frames.send(StartupFailed(
                        phase=phase, error=str(exc) if isinstance(exc, AsyncEngineError) else f"{type(exc).__name__}: {exc}",
                        error_type=error_type_name(exc), error_field=error_field(exc), records=trace.records,
                    ))
                tg.cancel_scope.cancel()
                return 1
            tg.cancel_scope.cancel()
        return 0

    return anyio.run(main, backend=os.environ.get("ASYNCENGINE_CHILD_BACKEND", "trio"))
