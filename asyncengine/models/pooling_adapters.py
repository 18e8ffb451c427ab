"""Decoder models as pooling models: a causal LM run as an embedder (Qwen3-Embedding, gte-Qwen2: the last
token's hidden state), and `*ForSequenceClassification` rerankers and classifiers on the same bases (a `score`
layer over the last token, as transformers' classes).

`as_pooling_model(LlamaForCausalLM)` is what the loader builds for `--runner pooling` on an architecture whose
class is a generation model: the same layers without the language-model head, reading checkpoints saved with
or without the `model.` prefix (a sentence-transformers export saves the bare `Qwen3Model`).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any

import torch
from torch import nn

from asyncengine.interfaces.pooler import Pooler
from asyncengine.models.llama import LlamaForCausalLM
from asyncengine.models.qwen2 import Qwen2ForCausalLM
from asyncengine.models.qwen3 import Qwen3ForCausalLM


def _with_model_prefix(weights: Iterable[tuple[str, torch.Tensor]], keep: tuple[str, ...]
                       ) -> Iterable[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue  # a pooling model has no language-model head
        yield (name if name.startswith(("model.",) + keep) else f"model.{name}"), tensor


@cache
def as_pooling_model(cls: Any) -> Any:
    """`cls` (a causal LM with `model`, `lm_head`, `load_weights`) without its head, as a pooling model."""

    def __init__(self: Any, config: Any, *, dtype: torch.dtype, max_position: int) -> None:
        cls.__init__(self, config, dtype=dtype, max_position=max_position)
        del self.lm_head
        self.tie_word_embeddings = False

    def load_weights(self: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cls.load_weights(self, _with_model_prefix(weights, ()))

    def compute_logits(self: Any, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{cls.__name__} runs as a pooling model (--runner pooling): it samples nothing")

    return type(f"{cls.__name__}AsPooling", (cls,), {
        "__init__": __init__, "load_weights": load_weights, "compute_logits": compute_logits,
        "is_pooling_model": True, "__module__": __name__, "__doc__": f"{cls.__name__} as a pooling model."})


class _ScoreHead(Pooler):
    """The last token's hidden state through the `score` layer (transformers' *ForSequenceClassification)."""

    def __init__(self, score: nn.Linear) -> None:
        super().__init__()
        self.score = score

    def pool(self, hidden_states: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        ends = torch.cumsum(torch.tensor(lengths, dtype=torch.int64, device=hidden_states.device), 0)
        return list(self.score(hidden_states[ends - 1]).unbind(0))


def _num_labels(config: Any) -> int:
    labels = getattr(config, "id2label", None)
    return len(labels) if isinstance(labels, dict) and labels else int(getattr(config, "num_labels", 2) or 2)


def sequence_classifier(cls: Any) -> Any:
    base: Any = as_pooling_model(cls)

    def __init__(self: Any, config: Any, *, dtype: torch.dtype, max_position: int) -> None:
        base.__init__(self, config, dtype=dtype, max_position=max_position)
        self.score = nn.Linear(config.hidden_size, _num_labels(config), bias=False, dtype=dtype)
        self.pooler = _ScoreHead(self.score)  # not a module: its layer is `score`, above

    def load_weights(self: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cls.load_weights(self, _with_model_prefix(weights, ("score.",)))

    name = cls.__name__.replace("ForCausalLM", "ForSequenceClassification")
    return type(name, (base,), {"__init__": __init__, "load_weights": load_weights, "__module__": __name__})


LlamaForSequenceClassification = sequence_classifier(LlamaForCausalLM)
Qwen2ForSequenceClassification = sequence_classifier(Qwen2ForCausalLM)
Qwen3ForSequenceClassification = sequence_classifier(Qwen3ForCausalLM)
