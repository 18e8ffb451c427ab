"""AdminEndpoint: vLLM's endpoint-plugin contract (attach_router on a FastAPI app, init_state with the
engine client), which has no counterpart here: `plugins port` must list it, naming the docs section."""

import os

from fastapi import FastAPI, Request
from vllm.entrypoints.openai.api_server import build_app  # noqa: F401  (vLLM's server internals)


class AdminEndpoint:
    name = "vllm_shaped_admin"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        @app.get("/v1/admin/ping")
        async def ping(raw_request: Request):
            return {"ping": os.environ.get("VLLM_PLUGINS"), "engine": raw_request.app.state.admin_client is not None}

    async def init_state(self, engine_client, state, args) -> None:
        state.admin_client = engine_client
