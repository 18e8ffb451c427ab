"""What every child process (engine core, worker) does around its role's work.

It dies with its parent, leaves Ctrl-C to the parent (a terminal sends SIGINT to the whole process
group; the parent decides how to stop), treats SIGTERM as "stop now", connects back with the secret,
receives its StartupParams, runs its start-up phases, and reports Ready or which phase failed.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from asyncengine.errors import AsyncEngineError, error_field, error_type_name
from asyncengine.runtime.connection import connect_to_parent
from asyncengine.runtime.spawn import ENV_ADDRESS, ENV_RANK, ENV_SECRET, die_with_parent
from asyncengine.wire.framing import FrameStream
from asyncengine.wire.messages import StartupFailed, StartupParams

logger = logging.getLogger(__name__)


class PhaseFailed(Exception):
    def __init__(self, phase: str, error: str, error_type: str | None = None, field: str | None = None) -> None:
        super().__init__(f"{phase}: {error}")
        self.phase = phase
        self.error = error
        self.error_type = error_type
        self.field = field


async def run_phase(phase: str, work: Callable[[], Awaitable[Any]]) -> Any:
    """Run one start-up phase; any failure becomes PhaseFailed naming the phase."""
    try:
        return await work()
    except Exception as exc:  # reported to the parent with the phase and the error; the child then exits
        logger.debug("start-up phase %r failed", phase, exc_info=True)
        message = str(exc) if isinstance(exc, AsyncEngineError) else f"{type(exc).__name__}: {exc}"
        raise PhaseFailed(phase, message, error_type_name(exc), error_field(exc)) from exc


def child_main(role: str, inbox_type: Any, body: Callable[[FrameStream, StartupParams], Awaitable[None]]) -> int:
    """Entry point of a child process: returns its exit code."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("ASYNCENGINE_LOG_LEVEL", "WARNING").upper(),
                        format=f"%(levelname)s {role} %(name)s: %(message)s")
    address, secret = os.environ[ENV_ADDRESS], os.environ[ENV_SECRET]
    rank = int(os.environ.get(ENV_RANK, "0"))

    async def main() -> int:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_sigterm, tg.cancel_scope)
            frames = await connect_to_parent(address, secret, inbox_type, role=role, rank=rank)
            try:
                params = await frames.receive()
                if not isinstance(params, StartupParams):
                    raise PhaseFailed("hand-shake", f"expected StartupParams, got {type(params).__name__}")
                await body(frames, params)
            except PhaseFailed as failure:
                logger.error("start-up failed in phase %r: %s", failure.phase, failure.error)
                with anyio.move_on_after(5.0):
                    await frames.send(
                        StartupFailed(phase=failure.phase, error=failure.error, error_type=failure.error_type,
                                      error_field=failure.field)
                    )
                tg.cancel_scope.cancel()
                return 1
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                tg.cancel_scope.cancel()  # the parent went away: nothing left to serve
                return 0
            tg.cancel_scope.cancel()
        return 0

    return anyio.run(main, backend=os.environ.get("ASYNCENGINE_CHILD_BACKEND", "trio"))


async def _stop_on_sigterm(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return
