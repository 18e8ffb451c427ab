"""Serving the app: the engine and the HTTP server (server/http_server.py: Hypercorn's protocols, our
connection tasks) in one task group, with graceful shutdown.

On SIGINT or SIGTERM: the server stops accepting connections, the engine stops admitting requests,
running requests (streams included) get `shutdown_grace_period` seconds to finish, what remains is
aborted, and the process exits 0. A second signal cuts the grace period short.

Idle keep-alive connections (an OpenAI client's connection pool keeps them) do not hold the exit:
the HTTP server would wait its whole graceful timeout for them (measured with Hypercorn's own worker:
32 s after the last request had finished), so once the engine's shutdown is over, responses get
FLUSH_SECONDS to reach their clients and serving stops.

When the engine dies (its process killed, a worker failure), the requests in flight get their error
(the engine fails them), the server stops accepting connections, and once the last of those responses
is out (or after `shutdown_grace_period`) serve returns EXIT_ENGINE_DEAD: a server whose engine is
gone cannot recover, and a supervisor (systemd, Kubernetes) restarts a process that exits.
`keep_serving_after_engine_death` keeps it up instead, answering 503. The server learns of the
death from `AsyncEngine.wait_dead()`, an event set when the engine dies.
"""

from __future__ import annotations

import ipaddress
import logging
import sys
from functools import partial
from typing import Any

import anyio
import trio
from hypercorn.config import Config as HypercornConfig

from asyncengine.config.engine import EngineConfig
from asyncengine.frontend.async_engine import AsyncEngine
from asyncengine.runtime.signals import drain_on_signal
from asyncengine.server.app import REQUEST_LOGGER, create_app
from asyncengine.server.parsers.selection import check_configured_parsers
from asyncengine.server.config import ServerConfig
from asyncengine.server.http_server import serve_http
from asyncengine.server.serving_io_processor import check_io_processor_name
from asyncengine.server.startup_log import log_startup_summary

logger = logging.getLogger("asyncengine.server")

FLUSH_SECONDS = 1.0
EXIT_OK, EXIT_ENGINE_DEAD = 0, 1


async def serve(engine_config: EngineConfig, server_config: ServerConfig, *, engine_class: Any = AsyncEngine,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> int:
    """Start the engine, serve the API until a signal (EXIT_OK) or the engine's death (EXIT_ENGINE_DEAD,
    unless keep_serving_after_engine_death), shutting down gracefully; the exit status. `engine_class`:
    what `start`s the client (the render server's RenderClient, which has no engine to die)."""
    warning = exposure_warning(server_config)
    if warning:
        print(f"asyncengine: warning: {warning}", file=sys.stderr, flush=True)
    # A wrong --io-processor-plugin fails here, before the model loads (create_app checks again); in a
    # thread, as the entry-point scan reads every installed distribution's metadata.
    await anyio.to_thread.run_sync(check_io_processor_name, engine_config.io_processor_plugin, engine_config.plugins)
    # So is an unknown --tool-call-parser / --reasoning-parser (or a parser plugin that does not load).
    await anyio.to_thread.run_sync(check_configured_parsers, server_config, engine_config.plugins)
    exit_status = EXIT_OK
    async with engine_class.start(engine_config) as engine:
        log_startup_summary(engine.model_config.served_model_name, getattr(engine, "startup_report", ()))
        app = create_app(engine, server_config)
        config = hypercorn_config(server_config)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signals, engine, stop, server_config.shutdown_grace_period,
                               nursery.cancel_scope)
            binds = await nursery.start(_serve_until_done, app, config, server_config.request_body_timeout, stop,
                                        nursery.cancel_scope)
            # The address a user (or a test with port 0) connects to, on stdout where scripts look for it.
            what = "" if getattr(engine, "has_engine", True) else " (a render server: no engine)"
            print(f"asyncengine: serving {engine.model_config.served_model_name}{what} on {', '.join(binds)}",
                  flush=True)
            task_status.started(binds)
            if not server_config.keep_serving_after_engine_death:
                await engine.wait_dead()
                exit_status = EXIT_ENGINE_DEAD
                await _stop_after_engine_death(app, engine, stop, server_config.shutdown_grace_period,
                                               nursery.cancel_scope)
        logger.info("server stopped")
    return exit_status


def hypercorn_config(server_config: ServerConfig) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"{server_config.host}:{server_config.port}"]
    config.graceful_timeout = server_config.shutdown_grace_period + 1.0
    config.keep_alive_timeout = server_config.keep_alive_timeout
    config.accesslog = None  # the app logs one line per request itself
    config.errorlog = logging.getLogger("hypercorn.error")  # through logging only, not also to stderr
    level = server_config.log_level_of_requests
    if level is not None:  # --uvicorn-log-level (vLLM's name): Hypercorn's messages and the per-request lines
        for name in ("hypercorn.error", REQUEST_LOGGER):
            logging.getLogger(name).setLevel(level)
    return config


def exposure_warning(server_config: ServerConfig) -> str | None:
    """What to tell the user who binds an address other machines can reach without an API key."""
    if server_config.api_key or _is_loopback(server_config.host):
        return None
    return (f"serving on {server_config.host} without an API key: anyone who can reach this address can use the "
            "server; set --api-key (or ASYNCENGINE_API_KEY), or bind 127.0.0.1")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


async def _stop_after_engine_death(app, engine: AsyncEngine, stop: trio.Event, grace_period: float,
                                   serving: trio.CancelScope) -> None:
    print(f"asyncengine: the engine died ({engine.dead_error}): the requests in flight get their error, then the "
          f"server exits with status {EXIT_ENGINE_DEAD} (--keep-serving-after-engine-death keeps it up, answering 503)",
          file=sys.stderr, flush=True)
    stop.set()  # no new connections
    with trio.move_on_after(grace_period):
        await app.responses.wait_idle()  # every request in flight has had its error sent
    serving.cancel()


async def _serve_until_done(app, config: HypercornConfig, request_body_timeout: float, stop: trio.Event,
                            serving: trio.CancelScope, *,
                            task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """HTTP until it returns (stopped, its connections done); then the signal task is done too."""
    await serve_http(app, config, request_body_timeout=request_body_timeout, shutdown_trigger=stop.wait,
                     task_status=task_status)
    serving.cancel()


async def _stop_on_signals(engine: AsyncEngine, stop: trio.Event, grace_period: float,
                           serving: trio.CancelScope) -> None:
    async def drain() -> None:
        stop.set()  # the HTTP server: no new connections
        await engine.shutdown(grace_period)

    await drain_on_signal(
        drain,
        announce=lambda name: _say(f"{name} received: no new connections; running requests have {grace_period:g} s "
                                   "to finish"),
        announce_again=lambda name: _say(f"{name} received again: aborting running requests now"),
    )
    # Every request has finished or been aborted; what the HTTP server may still wait for is idle
    # keep-alive connections (module docstring).
    await trio.sleep(FLUSH_SECONDS)
    serving.cancel()


def _say(line: str) -> None:
    print(f"asyncengine: {line}", file=sys.stderr, flush=True)
