"""How every asyncengine process reacts to SIGINT and SIGTERM, written once.

A serving process (the API server, an embedding application) stops gracefully: on the first signal
it stops admitting requests and lets the running ones finish for a grace period (`drain`), and a
second signal cuts that short. A child process (engine core, worker) leaves Ctrl-C to its parent (a
terminal sends SIGINT to the whole process group, and the parent decides how to stop) and treats
SIGTERM as "stop now".

    async with AsyncEngine.start(config) as engine, anyio.create_task_group() as tg:
        await tg.start(stop_on_signals, engine, tg.cancel_scope)
        ...  # serve

Each function opens its signal receiver before `task_status.started()`, so a caller that awaits
`tg.start(...)` knows a signal sent from then on is handled, not lost to the default handler.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio
from anyio.abc import TaskStatus

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

Announce = Callable[[str], None]  # told the signal's name ("SIGTERM")


class Drainable(Protocol):
    async def shutdown(self, grace_period: float) -> None:
        """Stop admitting work; let running work finish for up to `grace_period` seconds; abort the rest."""


def ignore_interrupts() -> None:
    """In a child process: Ctrl-C is its parent's to act on (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


async def drain_on_signal(
    drain: Callable[[], Awaitable[None]],
    *,
    signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
    announce: Announce,
    announce_again: Announce,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Wait for the first of `signals`, `announce` it and `await drain()`; a second signal, announced
    with `announce_again`, cuts the drain short. Returns once the drain is over, either way."""
    with anyio.open_signal_receiver(*signals) as received:
        task_status.started()
        async for first in received:
            announce(signal.Signals(first).name)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cut_short_on_next_signal, received, announce_again, tg.cancel_scope)
                await drain()
                tg.cancel_scope.cancel()
            return


async def _cut_short_on_next_signal(received, announce_again: Announce, scope: anyio.CancelScope) -> None:
    async for again in received:
        announce_again(signal.Signals(again).name)
        scope.cancel()
        return


async def stop_on_signals(engine: Drainable, scope: anyio.CancelScope, grace_period: float = 30.0, *,
                          task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """A process serving `engine` (an AsyncEngine): on SIGINT or SIGTERM, `engine.shutdown(grace_period)`
    (a second signal cuts it short), then cancel `scope` so that the process can exit 0."""

    def announce(name: str) -> None:
        logger.warning("%s received: finishing running requests (up to %.0f s), then exiting", name, grace_period)

    def announce_again(name: str) -> None:
        logger.warning("%s received again: aborting running requests now", name)

    await drain_on_signal(lambda: engine.shutdown(grace_period), announce=announce, announce_again=announce_again,
                          task_status=task_status)
    scope.cancel()


async def stop_now_on_sigterm(scope: anyio.CancelScope, *,
                              task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """A child process: SIGTERM cancels `scope` at once (its parent is stopping it); nothing to drain."""
    await drain_on_signal(_nothing, signals=(signal.SIGTERM,), announce=_silently, announce_again=_silently,
                          task_status=task_status)
    scope.cancel()


async def _nothing() -> None:
    pass


def _silently(name: str) -> None:
    pass
