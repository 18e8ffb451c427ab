"""The API of `asyncengine serve` in this process, for tests of the server's own logic (validation, error
shapes, routing, headers): an AsyncEngine (engine core in-process) on a tiny model and `create_app` over
it, reached through Quart's test client. No process to start, no socket, no port.

Its trio loop runs in a thread of its own (an anyio blocking portal), so a module-scoped fixture can
share one engine and app between plain, synchronous tests, each of which sends requests as it would to
a real server. End-to-end behaviour (connections, signals, processes, plugins in other processes) stays
with the real server of tests/support/server.py.

    with in_process_server({"model": path, "max_model_len": 512}, ServerConfig(api_key="k")) as server:
        status, headers, body = server.request("POST", "/v1/completions", {"prompt": "Hi"}, {...})
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from anyio.from_thread import BlockingPortal, start_blocking_portal

from asyncengine import AsyncEngine
from asyncengine.server.app import create_app
from asyncengine.server.config import ServerConfig


class InProcessServer:
    def __init__(self, portal: BlockingPortal, client: Any, engine: AsyncEngine) -> None:
        self._portal = portal
        self._client = client
        self.engine = engine  # the AsyncEngine under the app, for tests of the Python API on the same engine

    def call(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        """`await function(*args, **kwargs)` on the engine's event loop (an async engine method, say)."""
        return self._portal.call(functools.partial(function, *args, **kwargs))

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """(status, headers with lower-case names, raw body) of one request; a dict body is sent as JSON."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        return self._portal.call(functools.partial(self._send, method, path, data, headers or {}))

    async def _send(self, method: str, path: str, data: bytes | None, headers: dict[str, str]):
        response = await self._client.open(path, method=method, data=data, headers=headers)
        return (response.status_code, {name.lower(): value for name, value in response.headers.items()},
                await response.get_data())


@asynccontextmanager
async def _serving(engine_options: dict[str, Any], server_config: ServerConfig) -> AsyncIterator[Any]:
    async with AsyncEngine.start(**engine_options) as engine:
        app = create_app(engine, server_config)
        async with app.test_app() as running:
            yield running.test_client(), engine


@contextmanager
def in_process_server(engine_options: dict[str, Any],
                      server_config: ServerConfig | None = None) -> Iterator[InProcessServer]:
    """An engine started with `engine_options` (EngineConfig fields) and the API over it, until the block ends."""
    with start_blocking_portal("trio") as portal:
        with portal.wrap_async_context_manager(_serving(engine_options, server_config or ServerConfig())) as (
                client, engine):
            yield InProcessServer(portal, client, engine)
