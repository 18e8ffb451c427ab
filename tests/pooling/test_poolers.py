"""The built-in poolers over one run of rows (request after request), and what follows them per request:
Matryoshka truncation and L2 normalization for embeddings, softmax or sigmoid for class scores."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncengine.interfaces.pooler import PoolerRegistry
from asyncengine.pooling.step import PoolingStep
from asyncengine.wire.pooling import PoolingOptions

LENGTHS = [3, 1, 4]
ROWS = torch.arange(8 * 5, dtype=torch.float32).reshape(8, 5) ** 1.5  # 8 tokens of three requests


def pooled(name: str) -> list[torch.Tensor]:
    return PoolerRegistry.pooler_class(name)(None).pool(ROWS, LENGTHS)


def test_the_built_in_poolers():
    requests = ROWS.split(LENGTHS)
    assert all(torch.equal(a, r[-1]) for a, r in zip(pooled("LAST"), requests))
    assert all(torch.equal(a, r[0]) for a, r in zip(pooled("CLS"), requests))
    assert all(torch.allclose(a, r.mean(0)) for a, r in zip(pooled("MEAN"), requests))
    assert all(torch.equal(a, r) for a, r in zip(pooled("ALL"), requests))


def test_an_unknown_pooler_lists_the_registered_ones():
    with pytest.raises(ValueError, match="pooler 'MAX' .* is not registered; registered: ALL, CLS, LAST, MEAN"):
        PoolerRegistry.pooler_class("MAX")


def values(tensor: torch.Tensor, options: PoolingOptions) -> np.ndarray:
    out = PoolingStep._finish(tensor, options)
    return np.frombuffer(out.data, dtype="<f4").reshape(out.shape)


def test_embeddings_are_truncated_before_they_are_normalized():
    vector = torch.tensor([3.0, 4.0, 12.0])
    assert np.allclose(values(vector, PoolingOptions(task="embed", dimensions=2, normalize=True)), [0.6, 0.8])
    assert np.allclose(values(vector, PoolingOptions(task="embed", normalize=False)), [3.0, 4.0, 12.0])


def test_class_scores_go_through_softmax_or_sigmoid_unless_told_not_to():
    logits = torch.tensor([1.0, 2.0, 0.5])
    assert np.allclose(values(logits, PoolingOptions(task="classify")), torch.softmax(logits, 0).numpy())
    assert np.allclose(values(torch.tensor([0.3]), PoolingOptions(task="score")), [torch.sigmoid(torch.tensor(0.3))])
    assert np.allclose(values(logits, PoolingOptions(task="classify", activation=False)), logits.numpy())
    assert np.allclose(values(logits, PoolingOptions(task="encode")), logits.numpy())  # the raw output
