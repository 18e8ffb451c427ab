"""LoRA over HTTP (docs/lora.md): the adapter a request's `model` names, /v1/models' adapter cards, and the
runtime load and unload routes.

- `model` is the served model (or absent): the base model. Else an adapter known by name (--lora-modules,
  a runtime load, an earlier resolver answer), else the LoRA resolvers are asked (frontend/lora.py); none
  finding it is a 404 in OpenAI's shape naming the model. A resolver that raises fails that request
  with a 500 naming the resolver.
- An adapter is registered (loaded, or found by a resolver) only once the workers say it fits the model:
  every lora_A and lora_B the shape of the layer it targets (frontend/lora.py `fits_on_workers`). One
  made for another model is a 400 naming the adapter, the layer and both shapes, and is not registered.
- `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter`
  `{"lora_name"}` exist only with `--enable-runtime-lora-updates` (or the environment variable
  ASYNCENGINE_ALLOW_RUNTIME_LORA_UPDATING=1, after vLLM's); --api-key covers them like every /v1 route.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import msgspec
from quart import Response

from asyncengine.errors import RequestError
from asyncengine.frontend.lora import LoRAResolverFailed, fits_on_workers
from asyncengine.interfaces.lora_resolver import LoRARequest
from asyncengine.server.common import ServingContext
from asyncengine.server.errors import ApiError, from_engine_error
from asyncengine.server.protocol import ModelCard

RUNTIME_UPDATES_ENV = "ASYNCENGINE_ALLOW_RUNTIME_LORA_UPDATING"
LORA_ROUTES = [("/v1/load_lora_adapter", "POST", "load_lora_adapter"),
               ("/v1/unload_lora_adapter", "POST", "unload_lora_adapter")]


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None


def not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", type="NotFoundError", param="model",
                    code="model_not_found")


async def resolve_model(context: ServingContext, model: str | None) -> LoRARequest | None:
    """The adapter a request's `model` names; None for the served (base) model."""
    if model is None or context.serves(model):
        return None
    adapters = getattr(context.engine, "lora_adapters", None)
    if adapters is None:
        raise not_found(model)
    try:
        lora = await adapters.resolve(context.model_name, model, fits=partial(fits_on_workers,
                                                                               context.engine.collective_rpc))
    except LoRAResolverFailed as error:
        raise ApiError(500, str(error), type="InternalServerError", param="model",
                       code="lora_resolver_failed") from error
    except RequestError as error:
        raise from_engine_error(error) from error
    if lora is None:
        raise not_found(model)
    return lora


def model_cards(context: ServingContext, created: int) -> list[ModelCard]:
    """One card per adapter known by name, its base model as parent."""
    adapters = getattr(context.engine, "lora_adapters", None)
    if adapters is None:
        return []
    return [ModelCard(id=lora.lora_name, created=created, max_model_len=context.max_model_len, root=lora.lora_path,
                      parent=lora.base_model_name or context.model_name) for lora in adapters.adapters()]


def runtime_updates_enabled(server_config: Any) -> bool:
    flag = bool(getattr(server_config, "enable_runtime_lora_updates", False))
    return flag or os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


def add_lora_routes(app: Any, context: ServingContext, decode_body: Any) -> None:
    """The runtime load and unload routes (the caller checked that runtime updates are enabled)."""
    adapters = context.engine.lora_adapters
    fits = partial(fits_on_workers, context.engine.collective_rpc)

    async def load_lora_adapter() -> Response:
        body = await decode_body(LoadLoRAAdapterRequest)
        try:  # the config is read in a thread, the matrices' shapes checked on the workers: off the event loop
            await adapters.load(body.lora_name, body.lora_path, fits=fits)
        except RequestError as error:
            raise from_engine_error(error) from error
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", status=200,
                        content_type="text/plain")

    async def unload_lora_adapter() -> Response:
        body = await decode_body(UnloadLoRAAdapterRequest)
        if adapters.unload(body.lora_name) is None:
            raise ApiError(404, f"The LoRA adapter '{body.lora_name}' cannot be found.", type="NotFoundError",
                           param="lora_name", code="lora_not_found")
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", status=200,
                        content_type="text/plain")

    views = {"load_lora_adapter": load_lora_adapter, "unload_lora_adapter": unload_lora_adapter}
    for rule, method, name in LORA_ROUTES:
        app.add_url_rule(rule, name, views[name], methods=[method])


__all__ = ["LORA_ROUTES", "RUNTIME_UPDATES_ENV", "add_lora_routes", "model_cards", "resolve_model",
           "runtime_updates_enabled"]
