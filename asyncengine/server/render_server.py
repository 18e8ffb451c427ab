"""The render server: the API without an engine (vLLM's `vllm launch render MODEL`, CPU only).

`asyncengine launch render MODEL` (or `serve_render(engine_config, server_config)`) loads what the
frontend loads (the plugins a frontend runs, the model's config, its tokenizer and chat template)
and no engine core: no process, no thread, no weights. It answers what needs only those, as the
full server does (the same routes, server/routes.py): POST /tokenize, /detokenize,
/v1/chat/completions/render and /v1/completions/render (the request as the engine would take it,
rendered, tokenized and validated: vLLM's GenerateRequest shape), GET /v1/models, /health,
/version, /v1/startup, /openapi.json, /metrics. The routes that generate or pool answer 503 with
code `no_engine`, saying to send them to `asyncengine serve` (vLLM's render server does not mount
them: a 404 there).

Tokenizing and rendering run in the client's tokenizer pool, off the event loop, as the engine's
do: RenderClient is AsyncEngine's frontend half, with every call that would reach an engine core
refused (NoEngineError).

Endpoint plugins are served when their `required_tasks` is None or includes "render" (vLLM's
task name for this server); any other is refused at start-up, naming the plugin. vLLM's form gets
`init_state(None, state, args)` and ours `serve(None, task_status)`: there is no engine client to
give them, as in vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from asyncengine.config.engine import EngineConfig
from asyncengine.frontend.async_engine import AsyncEngine, frontend_start
from asyncengine.frontend.core_client import CoreClient
from asyncengine.frontend.output_processor import OutputKind
from asyncengine.frontend.processor import ProcessedRequest
from asyncengine.interfaces.endpoint import RENDER_TASKS
from asyncengine.interfaces.roles import FRONTEND
from asyncengine.server.config import ServerConfig
from asyncengine.server.run import serve


class NoEngineError(RuntimeError):
    """A call that needs an engine core, made on a RenderClient."""


def _no_engine(what: str) -> NoEngineError:
    return NoEngineError(f"{what} needs an engine, and this client has none (a render server: it renders and "
                         "tokenizes only): start one with `asyncengine serve` or AsyncEngine.start")


class _NoEngineCore(CoreClient):
    """The engine-core connection of a RenderClient: there is none."""

    process_name = "no engine core (a render server)"

    async def call(self, method: str, *args: Any) -> Any:
        raise _no_engine(f"the engine-core call {method!r}")

    async def send(self, message: Any) -> None:
        raise _no_engine(f"sending {type(message).__name__} to the engine core")

    async def receive(self) -> Any:
        raise _no_engine("receiving from the engine core")

    async def close(self) -> None:
        return None

    async def death_cause(self) -> str:
        return "there is no engine core (a render server)"

    def death_exception(self) -> BaseException | None:
        return None


class RenderClient(AsyncEngine):
    """The model's config, tokenizer (with its tokenizer pool) and chat template, and no engine core:
    `tokenize`, `detokenize`, `render_chat`, `chat_prompt` and `process_request(_async)` (validation
    without queueing) work as AsyncEngine's; generating, pooling and engine-core calls raise
    NoEngineError."""

    has_engine = False  # create_app and the routes read it: no generation, no scheduler stats
    served_tasks = RENDER_TASKS  # the endpoint plugins' required_tasks are checked against it

    @classmethod
    @asynccontextmanager
    async def start(cls, config: EngineConfig | None = None, **options: Any) -> AsyncIterator["RenderClient"]:
        """The frontend's start-up phases (plugins, then the model's config and tokenizer), no engine core."""
        async with frontend_start(config, options, lambda _: {FRONTEND}, endpoint_tasks=RENDER_TASKS) as (
                config, plugins, setup, trace):
            async with trace.phase("ready"):
                client = cls(config, setup, _NoEngineCore(), plugins, trace.records)
            try:
                yield client
            finally:
                await client.shutdown(0)

    async def submit(self, processed: ProcessedRequest, kind: OutputKind, *, nowait: bool = False) -> Any:
        raise _no_engine(f"running request {processed.request_id!r}")
        yield  # an async generator, as AsyncEngine.submit is


async def serve_render(engine_config: EngineConfig, server_config: ServerConfig, *,
                       task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> int:
    """Serve the render server until a signal (graceful, as `serve`'s: server/run.py); the exit status."""
    return await serve(engine_config, server_config, engine_class=RenderClient, task_status=task_status)
