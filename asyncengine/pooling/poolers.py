"""The built-in poolers (vLLM's pooling types), over one run of rows request after request (interfaces/pooler.py).

LAST: the last token's hidden state (decoder embedders: Qwen3-Embedding, gte-Qwen2); CLS: the first token's
(BERT's [CLS]); MEAN: the mean over the prompt's tokens (sentence-transformers' mean_tokens, all-MiniLM-L6-v2);
ALL: every token's hidden state (`[length, hidden]`). Each works on the whole step at once: index arithmetic,
no Python loop over the batch's tokens.
"""

from __future__ import annotations

import torch

from asyncengine.interfaces.pooler import Pooler


def _ends(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.cumsum(torch.tensor(lengths, dtype=torch.int64, device=device), 0)


class LastPooler(Pooler):
    def pool(self, hidden_states: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        return list(hidden_states[_ends(lengths, hidden_states.device) - 1].unbind(0))


class ClsPooler(Pooler):
    def pool(self, hidden_states: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        ends = _ends(lengths, hidden_states.device)
        lens = torch.tensor(lengths, dtype=torch.int64, device=hidden_states.device)
        return list(hidden_states[ends - lens].unbind(0))


class MeanPooler(Pooler):
    def pool(self, hidden_states: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        device = hidden_states.device
        lens = torch.tensor(lengths, dtype=torch.int64, device=device)
        segment = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens)
        # Summed in float32 whatever the model's dtype, as sentence-transformers' mean is.
        sums = torch.zeros(len(lengths), hidden_states.shape[-1], dtype=torch.float32, device=device)
        sums.index_add_(0, segment, hidden_states.float())
        return list((sums / lens.unsqueeze(1).float()).unbind(0))


class AllPooler(Pooler):
    def pool(self, hidden_states: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        return list(hidden_states.split(lengths, 0))
