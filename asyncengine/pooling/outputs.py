"""What pooling requests return, with vLLM's names: `PoolingRequestOutput` (`outputs.data`, a float32 tensor),
and the task-shaped views `EmbeddingRequestOutput` (`outputs.embedding`), `ClassificationRequestOutput`
(`outputs.probs`) and `ScoringRequestOutput` (`outputs.score`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

import numpy as np

from asyncengine.wire.pooling import PooledTensor


def tensor_of(pooled: PooledTensor) -> Any:
    """The pooled values as a float32 torch tensor of their shape (a copy: the message's bytes are read-only)."""
    import torch

    array = np.frombuffer(pooled.data, dtype="<f4").reshape(pooled.shape)
    return torch.from_numpy(array.copy())


@dataclass
class PoolingOutput:
    data: Any  # torch.Tensor, float32


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float

    @classmethod
    def of_values(cls, values: list[float]) -> "ScoringOutput":
        """A cross-encoder's one score (its one label through sigmoid; with two labels, the second's probability),
        or a bi-encoder's cosine similarity already folded into `data`."""
        return cls(values[-1] if len(values) <= 2 else values[0])


@dataclass
class _TaskRequestOutput:
    """A PoolingRequestOutput seen as one task's output: `outputs` is `view` of the pooled values."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    # list[float] -> the task's output (typed Any: mypy takes a callable class attribute for a method)
    view: ClassVar[Any]

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> Self:
        return cls(output.request_id, cls.view(output.outputs.data.flatten().tolist()), output.prompt_token_ids)


@dataclass
class EmbeddingRequestOutput(_TaskRequestOutput):
    outputs: EmbeddingOutput
    view = EmbeddingOutput


@dataclass
class ClassificationRequestOutput(_TaskRequestOutput):
    outputs: ClassificationOutput
    view = ClassificationOutput


@dataclass
class ScoringRequestOutput(_TaskRequestOutput):
    outputs: ScoringOutput
    view = ScoringOutput.of_values
