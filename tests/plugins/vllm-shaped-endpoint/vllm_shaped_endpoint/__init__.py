"""AdminEndpoint: vLLM's endpoint-plugin contract as its worked example writes it: attach_router adds
routes to a FastAPI app, init_state keeps the engine client (and an option) in the app's state, which
the routes read as raw_request.app.state; required_tasks names what it needs. EmbedOnlyEndpoint needs
an embedding server."""

import os

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse


class AdminEndpoint:
    name = "vllm_shaped_admin"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        @app.get("/v1/admin/model")
        async def model(raw_request: Request):
            engine_client = raw_request.app.state.admin_client
            if engine_client is None:
                raise HTTPException(status_code=503, detail="this server has no engine")
            return {"max_model_len": engine_client.model_config.max_model_len, "model": raw_request.app.state.model,
                    "allowed": os.environ.get("VLLM_PLUGINS")}

        @app.get("/v1/admin/workers")
        async def workers(raw_request: Request):
            results = await raw_request.app.state.admin_client.collective_rpc("describe")
            return {"ranks": len(results)}

        @app.post("/v1/admin/echo/{word}")
        async def echo(word: str, times: int, raw_request: Request):
            return {"words": [word] * times, "body": await raw_request.json()}

        @app.get("/v1/admin/count")
        async def count(n: int = 3):
            async def numbers():
                for i in range(n):
                    yield f"{i}\n"

            return StreamingResponse(numbers(), media_type="text/plain")

        @app.get("/v1/admin/fail")
        async def fail():
            raise RuntimeError("the admin route failed")

    async def init_state(self, engine_client, state, args) -> None:
        state.admin_client = engine_client
        state.model = args.model


class EmbedOnlyEndpoint(AdminEndpoint):
    name = "vllm_shaped_embed_only"
    required_tasks = ("embed",)


class DummyAdminEndpoint:
    """vLLM's dummy endpoint plugin (tests/plugins/vllm_add_dummy_endpoint_plugin): required_tasks None, so
    the CPU-only render server serves it too, calling init_state with engine_client None; its route then
    answers 503 instead of reaching for a client that does not exist."""

    name = "vllm_shaped_dummy_admin"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        @app.get("/v1/admin/scheduler_config")
        async def scheduler_config(raw_request: Request):
            engine_client = raw_request.app.state.dummy_engine_client
            if engine_client is None:
                raise HTTPException(status_code=503, detail="scheduler_config requires an engine, which this "
                                    "server does not have")
            results = await engine_client.collective_rpc("describe")
            return {"scheduler_config": results}

    async def init_state(self, engine_client, state, args) -> None:
        state.dummy_engine_client = engine_client
