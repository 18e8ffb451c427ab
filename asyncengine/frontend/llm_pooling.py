"""LLM's pooling methods, vLLM's names: `embed`, `encode`, `classify`, `score` (mixed into LLM: frontend/llm.py).

Each takes one prompt or a list (a string, a list of token ids, or `{"prompt_token_ids": [...]}`), checks and
tokenizes every one before any runs (a bad one leaves nothing half-started), submits them shortest first
(steps then hold prompts of like length, and pad little) and returns the outputs in input order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio

from asyncengine.errors import RequestError
from asyncengine.frontend.async_engine import AsyncEngine
from asyncengine.frontend.pooling import PoolingPrompt
from asyncengine.pooling.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from asyncengine.pooling.params import PoolingParams

if TYPE_CHECKING:
    from asyncengine.frontend.engine_client import EngineClient


def _prompt_list(prompts: Any) -> list[Any]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


class LLMPooling:
    engine: AsyncEngine
    _portal: Any

    def encode(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               task: str | None = None, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """The pooler's output for each prompt (`task`: "embed", "classify", "score" or "encode", the raw output)."""
        prompt_list = _prompt_list(prompts)
        params = self._pooling_params(pooling_params, len(prompt_list), truncate_prompt_tokens)
        return self._portal.call(self._pool_all, [(p, None) for p in prompt_list], params, task or "encode")

    def embed(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        prompt_list = _prompt_list(prompts)
        params = self._pooling_params(pooling_params, len(prompt_list), truncate_prompt_tokens)
        outputs = self._portal.call(self._pool_all, [(p, None) for p in prompt_list], params, "embed")
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def classify(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        prompt_list = _prompt_list(prompts)
        params = self._pooling_params(pooling_params, len(prompt_list), truncate_prompt_tokens)
        outputs = self._portal.call(self._pool_all, [(p, None) for p in prompt_list], params, "classify")
        return [ClassificationRequestOutput.from_base(output) for output in outputs]

    def score(self, data_1: Any, data_2: Any, pooling_params: PoolingParams | None = None, *,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """Scores of text pairs: one against one, one against many, or many against as many. A cross-encoder
        (a classifier) scores each pair in one pass; an embedding model scores the cosine of the two embeddings."""
        return self._portal.call(self.engine_score, data_1, data_2, pooling_params, truncate_prompt_tokens)

    async def engine_score(self, data_1: Any, data_2: Any, pooling_params: PoolingParams | None,
                           truncate_prompt_tokens: int | None) -> list[ScoringRequestOutput]:
        return await score_pairs(self.engine, data_1, data_2, pooling_params, truncate_prompt_tokens)

    # -- helpers -----------------------------------------------------------------------------------------

    @staticmethod
    def _pooling_params(pooling_params: Any, count: int, truncate: int | None) -> list[PoolingParams | None]:
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list: list[PoolingParams | None] = [pooling_params] * count
        else:
            params_list = list(pooling_params)
            if len(params_list) != count:
                raise RequestError(f"got {len(params_list)} PoolingParams for {count} prompts; pass one, or one per "
                                   "prompt", field="pooling_params")
        if truncate is not None:
            params_list = [PoolingParams(**{**(vars(p) if p is not None else {}), "truncate_prompt_tokens": truncate})
                           for p in params_list]
        return params_list

    async def _pool_all(self, pairs: list[tuple[Any, Any]], params_list: list[PoolingParams | None],
                        task: str) -> list[PoolingRequestOutput]:
        return await pool_many(self.engine, pairs, params_list, task)


async def pool_many(engine: EngineClient, pairs: list[tuple[Any, Any]], params_list: list[PoolingParams | None],
                    task: str, field: str = "prompt", nowait: bool = False) -> list[PoolingRequestOutput]:
    """Pool every (prompt, pair) with its params: all checked first, submitted shortest first, in input order.
    Each waits for its place under max_waiting_requests, or with `nowait` (the server) raises EngineOverloadedError
    when there is none (within an exception group, as any failure of one of them)."""
    prepared: list[PoolingPrompt] = []
    for index, ((prompt, pair), params) in enumerate(zip(pairs, params_list)):
        try:
            prepared.append(await engine.tokenizer_pool.run(
                engine.prepare_pooling, prompt, params, task=task, pair=pair, field=field))
        except RequestError as error:
            if len(pairs) > 1 and error.field == field:  # say which of the prompts
                error.field = f"{field}[{index}]" if field != "prompt" else field
                error.args = (f"prompt {index}: {error.message}",)
                error.message = error.args[0]
            raise
    if nowait:
        engine.check_fits_the_queue(len(prepared), field)
    results: list[PoolingRequestOutput | None] = [None] * len(prepared)

    async def one(index: int) -> None:
        results[index] = await engine.run_pooling(prepared[index], nowait=nowait)

    order = sorted(range(len(prepared)), key=lambda i: len(prepared[i].prompt_token_ids))
    async with anyio.create_task_group() as tg:
        for index in order:
            tg.start_soon(one, index)
            await anyio.lowlevel.checkpoint()  # each sends its request before the next starts: the order holds
    return [result for result in results if result is not None]


async def score_pairs(engine: EngineClient, data_1: Any, data_2: Any, pooling_params: PoolingParams | None,
                      truncate_prompt_tokens: int | None, field_1: str = "text_1",
                      field_2: str = "text_2", nowait: bool = False) -> list[ScoringRequestOutput]:
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise RequestError(f"{field_1 if not first else field_2} is empty: send at least one text",
                           field=field_1 if not first else field_2)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise RequestError(f"{field_1} has {len(first)} texts and {field_2} {len(second)}: send one against many, "
                           "or as many as each other", field=field_2)
    params = pooling_params or PoolingParams()
    if truncate_prompt_tokens is not None:
        params = PoolingParams(**{**vars(params), "truncate_prompt_tokens": truncate_prompt_tokens})
    pooler = engine.model_config.pooler
    if pooler is not None and pooler.is_classifier:  # a cross-encoder: each pair in one pass
        outputs = await pool_many(engine, list(zip(first, second)), [params] * len(first), "score", field=field_1,
                                  nowait=nowait)
        return [ScoringRequestOutput.from_base(output) for output in outputs]
    # A bi-encoder: the cosine similarity of the two embeddings.
    texts = first + second
    embedded = await pool_many(engine, [(t, None) for t in texts], [params] * len(texts), "embed", field=field_1,
                               nowait=nowait)
    import torch

    scores = []
    for index in range(len(first)):
        a, b = embedded[index], embedded[len(first) + index]
        value = float(torch.nn.functional.cosine_similarity(a.outputs.data.flatten(), b.outputs.data.flatten(), dim=0))
        a.outputs.data = torch.tensor([value])
        a.prompt_token_ids = a.prompt_token_ids + b.prompt_token_ids  # (the usage counts both texts)
        scores.append(ScoringRequestOutput.from_base(a))
    return scores
