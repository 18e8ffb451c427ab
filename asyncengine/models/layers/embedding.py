"""vLLM's `VocabParallelEmbedding` and `ParallelLMHead`, ours: the token embedding and the language-model head,
split by vocabulary across tensor-parallel ranks, with vLLM's constructors and weight loaders.

Rank r holds the rows of vocabulary range [start, end). The embedding looks up the tokens in its range
(zeros elsewhere) and sums across ranks; the head computes its range's logits and gathers the full
vocabulary on every rank, so every rank samples the same token.

Where vLLM pads the vocabulary to a multiple of `padding_size` per rank, the split here is as even as possible
and unpadded (`padding_size` is accepted and unused): the logits have exactly `num_embeddings` columns. Where
vLLM's ParallelLMHead refuses to be called (its LogitsProcessor does the product), ours computes the gathered
logits when called; `LogitsProcessor(vocab_size)(lm_head, hidden)` (models/layers/logits.py) works with both.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine import parallel_state as parallel
from asyncengine.models.layers import cpu_gemm
from asyncengine.models.layers.linear import check_shape, copy_checked, set_weight_attrs

DEFAULT_VOCAB_PADDING_SIZE = 64  # vLLM's default, accepted for its signature (no padding here)


def vocab_ranges(vocab_size: int) -> list[tuple[int, int]]:
    return parallel.split_evenly(vocab_size, parallel.world_size())


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None,
                 org_num_embeddings: int | None = None, padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.org_vocab_size = org_num_embeddings or num_embeddings
        self.padding_size = padding_size
        self.prefix = prefix
        self.tp_size, self.tp_rank = parallel.world_size(), parallel.rank()
        self.ranges = vocab_ranges(num_embeddings)
        self.start, self.end = self.ranges[self.tp_rank]
        self.num_embeddings_per_partition = self.end - self.start
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.end - self.start, embedding_dim, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    @property
    def vocab_size(self) -> int:
        return self.num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill(outside, 0)
        embedded = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return parallel.all_reduce(embedded)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """The whole `[vocab, hidden]` tensor (or `[vocab]`, a head's bias): this rank's rows of it."""
        name = f"{self.prefix}.weight" if self.prefix else f"{type(self).__name__}.weight"
        check_shape(loaded_weight, (self.num_embeddings,) + tuple(param.shape[1:]), name)
        copy_checked(param.data, loaded_weight.narrow(0, self.start, self.end - self.start), name)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings_per_partition}, embedding_dim={self.embedding_dim}, "
                f"org_vocab_size={self.org_vocab_size}, tp_size={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None, org_num_embeddings: int | None = None,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, org_num_embeddings, padding_size, quant_config,
                         prefix)
        self.quant_config = quant_config
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(self.end - self.start, dtype=self.weight.dtype),
                                                          requires_grad=False)
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)
        self._packed: torch.Tensor | None = None  # the weight reordered for oneDNN (cpu_gemm.py), where it applies
        self._pack_tried = False

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """vLLM's: share the embedding's weight (tied word embeddings)."""
        self.weight = embed_tokens.weight
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The full vocabulary's logits, on every rank."""
        if not self._pack_tried:  # on first use, once the (possibly tied) weight is loaded
            self._packed, self._pack_tried = cpu_gemm.pack(self.weight), True
        logits = cpu_gemm.linear(hidden, self.weight, self._packed, self.bias)
        if self.tp_size == 1:
            return logits
        return parallel.all_gather_last_dim(logits, [end - start for start, end in self.ranges])


__all__ = ["DEFAULT_VOCAB_PADDING_SIZE", "ParallelLMHead", "VocabParallelEmbedding", "vocab_ranges"]
