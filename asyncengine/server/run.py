"""Serving the app: the engine and Hypercorn's trio worker in one task group, with graceful shutdown.

On SIGINT or SIGTERM: Hypercorn stops accepting connections, the engine stops admitting requests,
running requests (streams included) get `shutdown_grace_period` seconds to finish, what remains is
aborted, and the process exits 0. A second signal cuts the grace period short.

Idle keep-alive connections (an OpenAI client's connection pool keeps them) do not hold the exit:
Hypercorn would wait its whole graceful timeout for them (measured: 32 s after the last request had
finished), so once the engine's shutdown is over, responses get FLUSH_SECONDS to reach their clients
and serving stops.
"""

from __future__ import annotations

import logging
import signal
import sys
from functools import partial

import anyio
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from asyncengine.config.engine import EngineConfig
from asyncengine.frontend.async_engine import AsyncEngine
from asyncengine.server.app import create_app
from asyncengine.server.config import ServerConfig
from asyncengine.server.serving_io_processor import check_io_processor_name

logger = logging.getLogger("asyncengine.server")

FLUSH_SECONDS = 1.0


async def serve(engine_config: EngineConfig, server_config: ServerConfig, *,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Start the engine, serve the API until a signal, then shut down gracefully."""
    # A wrong --io-processor-plugin fails here, before the model loads (create_app checks again); in a
    # thread, as the entry-point scan reads every installed distribution's metadata.
    await anyio.to_thread.run_sync(check_io_processor_name, engine_config.io_processor_plugin, engine_config.plugins)
    async with AsyncEngine.start(engine_config) as engine:
        app = create_app(engine, server_config)
        config = HypercornConfig()
        config.bind = [f"{server_config.host}:{server_config.port}"]
        config.graceful_timeout = server_config.shutdown_grace_period + 1.0
        config.accesslog = None  # the app logs one line per request itself
        config.errorlog = logging.getLogger("hypercorn.error")  # through logging only, not also to stderr
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signals, engine, stop, server_config.shutdown_grace_period,
                               nursery.cancel_scope)
            binds = await nursery.start(_serve_until_done, app, config, stop, nursery.cancel_scope)
            # The address a user (or a test with port 0) connects to, on stdout where scripts look for it.
            print(f"asyncengine: serving {engine.model_config.served_model_name} on {', '.join(binds)}", flush=True)
            task_status.started(binds)
        logger.info("server stopped")


async def _serve_until_done(app, config: HypercornConfig, stop: trio.Event, serving: trio.CancelScope, *,
                            task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Hypercorn until it returns (stopped, its connections done); then the signal task is done too."""
    await hypercorn_serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)
    serving.cancel()


async def _stop_on_signals(engine: AsyncEngine, stop: trio.Event, grace_period: float,
                           serving: trio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for received in signals:
            print(f"asyncengine: {signal.Signals(received).name} received: no new connections; running requests "
                  f"have {grace_period:g} s to finish", file=sys.stderr, flush=True)
            stop.set()
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cut_short_on_second_signal, signals, tg.cancel_scope)
                await engine.shutdown(grace_period)
                tg.cancel_scope.cancel()
            # Every request has finished or been aborted; what Hypercorn may still wait for is idle
            # keep-alive connections (module docstring).
            await trio.sleep(FLUSH_SECONDS)
            serving.cancel()
            return


async def _cut_short_on_second_signal(signals, scope: anyio.CancelScope) -> None:
    async for received in signals:
        print(f"asyncengine: {signal.Signals(received).name} received again: aborting running requests now",
              file=sys.stderr, flush=True)
        scope.cancel()
        return
