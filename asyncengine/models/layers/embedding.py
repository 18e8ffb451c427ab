"""Token embedding and language-model head, split by vocabulary across tensor-parallel ranks.

Rank r holds the rows of vocabulary range [start, end). The embedding looks up the tokens in its range
(zeros elsewhere) and sums across ranks; the head computes its range's logits and gathers the full
vocabulary on every rank, so every rank samples the same token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.models.layers import cpu_gemm
from asyncengine.models.layers.linear import check_shape, copy_checked
from asyncengine import parallel_state as parallel


def vocab_ranges(vocab_size: int) -> list[tuple[int, int]]:
    return parallel.split_evenly(vocab_size, parallel.world_size())


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.ranges = vocab_ranges(vocab_size)
        self.start, self.end = self.ranges[parallel.rank()]
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if parallel.world_size() == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill(outside, 0)
        embedded = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return parallel.all_reduce(embedded)

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None, name: str) -> None:
        check_shape(loaded, (self.vocab_size, param.shape[1]), name)
        copy_checked(param.data, loaded.narrow(0, self.start, self.end - self.start), name)


class ParallelLMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.ranges = vocab_ranges(vocab_size)
        self.start, self.end = self.ranges[parallel.rank()]
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size, dtype=dtype), requires_grad=False)
        self._packed: torch.Tensor | None = None  # the weight reordered for oneDNN (cpu_gemm.py), where it applies
        self._pack_tried = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self._pack_tried:  # on first use, once the (possibly tied) weight is loaded
            self._packed, self._pack_tried = cpu_gemm.pack(self.weight), True
        logits = cpu_gemm.linear(hidden, self.weight, self._packed)
        return parallel.all_gather_last_dim(logits, [end - start for start, end in self.ranges])

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None, name: str) -> None:
        check_shape(loaded, (self.vocab_size, param.shape[1]), name)
        copy_checked(param.data, loaded.narrow(0, self.start, self.end - self.start), name)
