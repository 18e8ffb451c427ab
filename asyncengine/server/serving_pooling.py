"""The pooling routes: POST /v1/embeddings (OpenAI's shape, float or base64), /pooling (the pooler's raw output,
or an IO processor's response over pooled outputs), /classify, /score and /v1/score (vLLM's), /rerank, /v1/rerank
and /v2/rerank (Jina's and Cohere's shape), /v2/embed (Cohere's v2 embed). Each input is checked and tokenized before any runs, then all run concurrently
(frontend/llm_pooling.py: `pool_many`, `score_pairs`); what the engine refuses is a 400 naming the field. Each
input takes a place under max_waiting_requests without waiting for one: with none free the request is a 503
`engine_overloaded` with Retry-After, as on the generation routes.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
from quart import Response, g

from asyncengine.errors import RequestError
from asyncengine.frontend.llm_pooling import pool_many, score_pairs
from asyncengine.pooling.outputs import PoolingRequestOutput
from asyncengine.pooling.params import PoolingParams
from asyncengine.server.common import ServingContext, check_model, engine_errors_as_http, new_id
from asyncengine.server.errors import ApiError, bad_request, from_engine_error
from asyncengine.server.protocol_pooling import (
    SCORE_PAIRS, ClassificationData, ClassificationRequest, ClassificationResponse, CohereApiVersion,
    CohereBilledUnits, CohereEmbeddings, CohereEmbedRequest, CohereEmbedResponse, CohereMeta, EmbeddingData,
    EmbeddingRequest, EmbeddingResponse, PoolingData, PoolingIOResponse, PoolingRequest, PoolingResponse, PoolingUsage, RerankDocument,
    RerankRequest, RerankResponse, RerankResult, RerankUsage, ScoreData, ScoreRequest, ScoreResponse,
)
from asyncengine.server.io_processor_calls import RequestCalls, plugin_error
from asyncengine.server.serving_io_processor import IOProcessorSetup, _engine_prompt, _prompt_list

# (rule, method, view name) of each pooling route, served next to the other built-in routes (routes.py).
POOLING_ROUTES: list[tuple[str, str, str]] = [
    ("/v1/embeddings", "POST", "embeddings"),
    ("/pooling", "POST", "pooling"),
    ("/classify", "POST", "classify"),
    ("/score", "POST", "score"),
    ("/v1/score", "POST", "v1_score"),
    ("/rerank", "POST", "rerank"),
    ("/v1/rerank", "POST", "v1_rerank"),
    ("/v2/rerank", "POST", "v2_rerank"),
    ("/v2/embed", "POST", "v2_embed"),
]


def input_prompts(value: Any, field: str = "input") -> list[str | list[int]]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids or a list of lists of them."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise bad_request(f"{field} is empty: send a string, a list of strings or token ids", param=field,
                          code="invalid_value")
    if all(isinstance(item, int) for item in value):
        return [list(value)]
    if all(isinstance(item, str) for item in value) or all(isinstance(item, list) for item in value):
        return list(value)
    raise bad_request(f"{field} mixes strings, token ids and lists: send one shape", param=field,
                      code="invalid_value")


def _usage(outputs: list[PoolingRequestOutput]) -> PoolingUsage:
    tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


def _encoded(output: PoolingRequestOutput, encoding_format: str) -> Any:
    data = output.outputs.data
    if encoding_format == "base64":  # float32 little-endian, as OpenAI's clients decode it
        return base64.b64encode(np.ascontiguousarray(data.numpy(), dtype="<f4").tobytes()).decode("ascii")
    return data.tolist()


def _params(request: Any, **fields: Any) -> PoolingParams:
    try:
        return PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens, **fields)
    except RequestError as error:
        raise from_engine_error(error) from error


async def _run(call: Awaitable[Any]) -> Any:
    """Await the pooling of a request's inputs (a task group: its failures come as an exception group), with the
    first engine error among them as an HTTP error (the generation routes' 400 and 503s)."""
    with engine_errors_as_http():
        return await call


def pooling_views(context: ServingContext, decode_body: Callable[[type], Awaitable[Any]],
                  json_response: Callable[[Any], Response]) -> dict[str, Callable[[], Coroutine[Any, Any, Response]]]:
    """The views of POOLING_ROUTES, by view name (routes.py registers them)."""
    engine = context.engine
    model_name = context.model_name

    async def body(struct: type) -> Any:
        request = await decode_body(struct)
        check_model(context, request.model)
        return request

    async def pool_inputs(request: Any, params: PoolingParams, task: str) -> list[PoolingRequestOutput]:
        prompts = input_prompts(request.input)
        pairs = [(prompt, None) for prompt in prompts]
        return await _run(pool_many(engine, pairs, [params] * len(pairs), task, field="input", nowait=True))

    async def encoded_inputs(request: EmbeddingRequest | PoolingRequest, task: str) -> tuple[list[Any], PoolingUsage]:
        """Each input pooled and encoded as `encoding_format` says, in input order; and the usage."""
        params = _params(request, dimensions=request.dimensions, normalize=request.normalize)
        outputs = await pool_inputs(request, params, task)
        return [_encoded(output, request.encoding_format) for output in outputs], _usage(outputs)

    async def embeddings() -> Response:
        request = await body(EmbeddingRequest)
        values, usage = await encoded_inputs(request, "embed")
        return json_response(EmbeddingResponse(
            id=new_id("embd", g.request_id), created=int(time.time()), model=model_name, usage=usage,
            data=[EmbeddingData(index=i, embedding=value) for i, value in enumerate(values)]))

    async def pooling() -> Response:
        request = await body(PoolingRequest)
        if request.data is not None:
            return json_response(await _pool_with_io_processor(context, request))
        if request.input is None:
            raise bad_request("send `input` (or `data`, for the IO processor --io-processor-plugin names)",
                              param="input", code="missing_parameter")
        values, usage = await encoded_inputs(request, request.task or "encode")
        return json_response(PoolingResponse(
            id=new_id("pool", g.request_id), created=int(time.time()), model=model_name, usage=usage,
            data=[PoolingData(index=i, data=value) for i, value in enumerate(values)]))

    async def classify() -> Response:
        request = await body(ClassificationRequest)
        outputs = await pool_inputs(request, _params(request), "classify")
        labels = engine.model_config.hf_config.get("id2label") or {}
        data = []
        for index, output in enumerate(outputs):
            probs = output.outputs.data.flatten().tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=index, label=labels.get(str(best), labels.get(best)), probs=probs,
                                           num_classes=len(probs)))
        return json_response(ClassificationResponse(id=new_id("classify", g.request_id), created=int(time.time()),
                                                    model=model_name, data=data, usage=_usage(outputs)))

    async def score() -> Response:
        request = await body(ScoreRequest)
        (field_1, data_1), (field_2, data_2) = score_sides(request)
        results = await _run(score_pairs(engine, data_1, data_2, _params(request), None, field_1=field_1,
                                         field_2=field_2, nowait=True))
        tokens = sum(len(r.prompt_token_ids) for r in results)
        data = [ScoreData(index=i, score=r.outputs.score) for i, r in enumerate(results)]
        return json_response(ScoreResponse(id=new_id("score", g.request_id), created=int(time.time()),
                                           model=model_name, data=data,
                                           usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)))

    async def rerank() -> Response:
        request = await body(RerankRequest)
        if not request.documents:
            raise bad_request("documents is empty: send at least one document", param="documents",
                              code="invalid_value")
        if request.top_n is not None and request.top_n < 1:
            raise bad_request(f"top_n must be at least 1, got {request.top_n}", param="top_n", code="invalid_value")
        results = await _run(score_pairs(engine, request.query, request.documents, _params(request), None,
                                         field_1="query", field_2="documents", nowait=True))
        ranked = sorted(range(len(results)), key=lambda i: -results[i].outputs.score)[: request.top_n]
        items = [RerankResult(index=i, relevance_score=results[i].outputs.score,
                              document=RerankDocument(text=request.documents[i]) if request.return_documents else None)
                 for i in ranked]
        tokens = sum(len(r.prompt_token_ids) for r in results)
        return json_response(RerankResponse(id=new_id("rerank", g.request_id), model=model_name, results=items,
                                            usage=RerankUsage(total_tokens=tokens)))

    async def cohere_embed() -> Response:
        request = await body(CohereEmbedRequest)
        params = _cohere_params(request)
        try:
            outputs = await _run(pool_many(engine, [(text, None) for text in request.texts],
                                           [params] * len(request.texts), "embed", field="texts", nowait=True))
        except ApiError as error:
            raise _cohere_names(error) from error
        embeddings = CohereEmbeddings()
        for kind in dict.fromkeys(request.embedding_types):  # each type once, in the order asked
            values = [_encoded(output, "base64" if kind == "base64" else "float") for output in outputs]
            if kind in ("binary", "ubinary"):
                values = [_sign_bits(output, signed=kind == "binary") for output in outputs]
            setattr(embeddings, "floats" if kind == "float" else kind, values)
        tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return json_response(CohereEmbedResponse(
            id=new_id("embed", g.request_id), embeddings=embeddings, texts=request.texts,
            meta=CohereMeta(api_version=CohereApiVersion(), billed_units=CohereBilledUnits(input_tokens=tokens))))

    return {"embeddings": embeddings, "pooling": pooling, "classify": classify, "score": score, "v1_score": score,
            "rerank": rerank, "v1_rerank": rerank, "v2_rerank": rerank, "v2_embed": cohere_embed}


def score_sides(request: ScoreRequest) -> tuple[tuple[str, Any], tuple[str, Any]]:
    """(name, value) of each side of a score request: exactly one of vLLM's pairs of names, both of it."""
    sent = [name for name in ("text_1", "text_2", "queries", "documents", "items", "data_1", "data_2")
            if getattr(request, name) is not None]
    for first, second in SCORE_PAIRS:
        if first in sent and second in sent and len(sent) == 2:
            return (first, getattr(request, first)), (second, getattr(request, second))
    pairs = ", ".join(f"{a}/{b}" for a, b in SCORE_PAIRS)
    given = ", ".join(sent) or "none of them"
    raise bad_request(f"send one pair of texts to score, by one of vLLM's names for it ({pairs}); got {given}",
                      param=sent[0] if sent else "text_1", code="invalid_value")


def _cohere_params(request: CohereEmbedRequest) -> PoolingParams:
    unbuilt = sorted(set(request.embedding_types) - {"float", "base64", "binary", "ubinary"})
    if unbuilt:
        raise bad_request(f"embedding_types {unbuilt} are not built here: int8 and uint8 need Cohere's calibration "
                          "ranges; ask for float, base64, binary or ubinary", param="embedding_types",
                          code="invalid_value")
    if request.truncate != "START" and request.max_tokens is not None:
        raise bad_request(f"max_tokens cuts each text, and only truncate START (keep the last tokens) is built here, "
                          f"not {request.truncate}: send truncate START, or leave max_tokens out",
                          param="max_tokens", code="invalid_value")
    truncate = (request.max_tokens or -1) if request.truncate == "START" else None
    try:
        return PoolingParams(truncate_prompt_tokens=truncate, dimensions=request.output_dimension)
    except RequestError as error:
        raise _cohere_names(from_engine_error(error)) from error


def _cohere_names(error: ApiError) -> ApiError:
    """An error naming PoolingParams' `dimensions` names Cohere's `output_dimension`, the field the client sent."""
    if error.param == "dimensions":
        error.param = "output_dimension"
    return error


def _sign_bits(output: PoolingRequestOutput, *, signed: bool) -> list[int]:
    """Cohere's ubinary (and binary) embedding: one bit per dimension, 1 where the value is positive, packed 8
    to a byte, most significant bit first (numpy's packbits); binary is each byte less 128, as int8."""
    packed = np.packbits(output.outputs.data.flatten().numpy() > 0).astype(np.int16)
    return (packed - 128 if signed else packed).tolist()


async def _pool_with_io_processor(context: ServingContext, request: PoolingRequest) -> PoolingIOResponse:
    """vLLM's IO processors on /pooling, in vLLM's order (server/io_processor_calls.py): parse the request's
    `data`, `pre_process` makes the prompts, `merge_pooling_params` the parameters they are pooled with, each is
    pooled, and `post_process` (the PoolingRequestOutputs in prompt order) makes the response's `data`."""
    setup: IOProcessorSetup = context.io_processor or IOProcessorSetup()
    if setup.processor is None or setup.name is None:
        installed = ", ".join(setup.installed) or "none is installed"
        raise ApiError(400, f"`data` is for an IO processor, and this server has none: start it with "
                            f"--io-processor-plugin NAME (installed IO processors: {installed})",
                       param="data", code="io_processor_not_configured")
    engine = context.engine
    request_id = new_id("pool", g.request_id)
    calls = RequestCalls(setup.name, setup.processor, g.request_id or request_id)
    prompts = _prompt_list(setup.name, await calls.pre_process(await calls.parse(request)))
    engine_prompts = [_engine_prompt(context, setup.name, i, prompt) for i, prompt in enumerate(prompts)]
    params = await calls.merge_params(_params(request, task=request.task, dimensions=request.dimensions,
                                              normalize=request.normalize), "pooling")
    if not isinstance(params, PoolingParams):
        raise plugin_error(setup.name, setup.processor, "merge_pooling_params", 500,
                           f"returned {type(params).__name__}, not a PoolingParams")
    task = params.task if params.task not in (None, "plugin") else engine.pooling_task_default()
    outputs = await _run(pool_many(engine, [(p, None) for p in engine_prompts], [params] * len(engine_prompts), task,
                                   nowait=True))
    data = calls.encode(await calls.response_value(await calls.post_process(outputs)))
    return PoolingIOResponse(id=request_id, created=int(time.time()), model=context.model_name,
                             plugin=setup.name, data=data, usage=_usage(outputs))
