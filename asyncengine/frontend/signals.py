"""Graceful shutdown on SIGINT/SIGTERM for a process that serves an AsyncEngine.

    async with AsyncEngine.start(config) as engine, anyio.create_task_group() as tg:
        tg.start_soon(stop_on_signals, engine, tg.cancel_scope)
        ...  # serve

On the first signal the engine stops admitting requests, running ones get `grace_period` seconds
to finish, the rest are aborted, and the scope is cancelled so the process can exit 0. A second
signal during the grace period cuts it short.
"""

from __future__ import annotations

import logging
import signal

import anyio

logger = logging.getLogger(__name__)


async def stop_on_signals(engine, scope: anyio.CancelScope, grace_period: float = 30.0) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for received in signals:
            logger.warning("%s received: finishing running requests (up to %.0f s), then exiting",
                           signal.Signals(received).name, grace_period)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cut_short_on_second_signal, signals, tg.cancel_scope)
                await engine.shutdown(grace_period)
                tg.cancel_scope.cancel()
            scope.cancel()
            return


async def _cut_short_on_second_signal(signals, scope: anyio.CancelScope) -> None:
    async for received in signals:
        logger.warning("%s received again: aborting running requests now", signal.Signals(received).name)
        scope.cancel()
        return
