"""What every child process (engine core, worker) does around its role's work.

It exits when its parent dies, leaves Ctrl-C to the parent (a terminal sends SIGINT to the whole
process group; the parent decides how to stop), treats SIGTERM as "stop now", connects back with the
secret, receives its StartupParams, runs its start-up phases (recorded in the trace its caller makes), and
reports Ready or, naming the phase that failed, StartupFailed, with its records either way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import anyio

from asyncengine.errors import AsyncEngineError, StartupError, error_field, error_type_name
from asyncengine.runtime.connection import connect_to_parent
from asyncengine.runtime.groups import single_exceptions
from asyncengine.runtime.signals import ignore_interrupts, stop_now_on_sigterm
from asyncengine.runtime.spawn import ENV_ADDRESS, ENV_RANK, ENV_SECRET, die_with_parent
from asyncengine.wire.framing import FrameStream
from asyncengine.wire.messages import CheckParams, StartupFailed, StartupParams
from asyncengine.wire.startup import StartupRecord

logger = logging.getLogger(__name__)


class ChildTrace(Protocol):
    """What a child needs of its start-up trace to report it. The caller passes the trace's type
    (the plugin runtime's StartupTrace): the plugin runtime fills the trace, this plumbing only sends it."""

    records: list[StartupRecord]
    ready: bool  # set once the process reported Ready: later failures are not start-up failures

    @property
    def process(self) -> str: ...  # "the worker rank 0 (pid 123)"

    def named_failure(self, phase: str, exc: BaseException) -> Exception: ...  # `exc`, naming process and phase


Trace = TypeVar("Trace", bound=ChildTrace)


class HandshakeFailure(StartupError):
    """The parent sent something other than StartupParams or CheckParams first."""

    names_its_process = True  # reported as it is, in the hand-shake phase
    phase = "hand-shake"


def child_main(role: str, inbox_type: Any, body: Callable[[FrameStream, StartupParams, Trace], Awaitable[None]],
               new_trace: Callable[[str], Trace], *,
               check: Callable[[FrameStream, CheckParams, Trace], Awaitable[None]]) -> int:
    """Entry point of a child process: returns its exit code. `role` is "engine core" or "worker";
    `new_trace(name)` makes the process's start-up trace, which `body` (sent StartupParams: serve) or
    `check` (sent CheckParams: `plugins check`, no model) fills."""
    die_with_parent()
    ignore_interrupts()
    logging.basicConfig(level=os.environ.get("ASYNCENGINE_LOG_LEVEL", "WARNING").upper(),
                        format=f"%(levelname)s {role} %(name)s: %(message)s")
    address, secret = os.environ[ENV_ADDRESS], os.environ[ENV_SECRET]
    rank = int(os.environ.get(ENV_RANK, "0"))
    trace = new_trace(f"worker rank {rank}" if role == "worker" else role)

    async def main() -> int:
        async with anyio.create_task_group() as tg:
            await tg.start(stop_now_on_sigterm, tg.cancel_scope)
            frames = await connect_to_parent(address, secret, inbox_type, role=role, rank=rank)
            try:
                params = await frames.receive()
                with single_exceptions():  # the body's own task group wraps even one failure in a group
                    if isinstance(params, StartupParams):
                        await body(frames, params, trace)
                    elif isinstance(params, CheckParams):
                        await check(frames, params, trace)
                    else:
                        raise HandshakeFailure(f"expected StartupParams or CheckParams, got {type(params).__name__}")
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
                    exc = trace.named_failure(phase, exc)
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
