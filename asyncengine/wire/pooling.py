"""Pooling on the wire: what a pooling request asks of the worker, and the tensor it sends back."""

from __future__ import annotations

import msgspec


class PoolingOptions(msgspec.Struct, frozen=True, kw_only=True):
    """A pooling request's PoolingParams, resolved by the frontend (asyncengine/pooling/params.py).

    `task`: "embed" (one vector, truncated to `dimensions` then L2-normalized when `normalize`),
    "classify" (the model's class scores, through softmax or sigmoid when `activation`), "score" (as
    classify, for a cross-encoder's pair), "encode" (the pooler's output as it is), and the per-token
    tasks "token_embed" (every token's final hidden state, `[length, hidden]`, each L2-normalized when
    `normalize`) and "token_classify" (the model's head at every token, `[length, labels]`, each through
    softmax or sigmoid when `activation`). `token_type_ids`:
    BERT's segment ids, one per prompt token (a cross-encoder's pair), None for all zeros."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool = True
    activation: bool = True
    token_type_ids: list[int] | None = None


class PooledTensor(msgspec.Struct, frozen=True, array_like=True):
    """One request's pooled output: float32 values (little-endian bytes) of the given shape."""

    data: bytes
    shape: list[int]
