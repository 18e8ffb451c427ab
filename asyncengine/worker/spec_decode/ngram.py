"""The n-gram proposer (vLLM's `ngram`, "prompt lookup"): draft the tokens that followed an earlier
occurrence of the history's last tokens.

vLLM's rule, kept: the longest suffix of the history, from `prompt_lookup_max` tokens down to
`prompt_lookup_min`, that occurs earlier in the history wins; among that suffix's earlier occurrences
the first one (earliest in the history) is used, and the drafts are the tokens after it, at most k,
at most to the end of the history, and never past `max_model_len`. An occurrence may overlap the suffix
itself (a run of one repeated token proposes more of it).

Vectorised over the batch with numpy: one comparison of every position with each request's last token
finds the candidate ends, then each further suffix length is checked on the candidates only (a loop over
lengths, at most `prompt_lookup_max`, never over positions).
"""

from __future__ import annotations

import numpy as np

from asyncengine.config.speculative import SpeculativeConfig
from asyncengine.interfaces.spec_decode import DraftTokens, ProposalBatch, Proposer, ProposerContext


def propose_ngram(token_ids: np.ndarray, num_tokens: np.ndarray, *, k: int, min_n: int, max_n: int,
                  max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Drafts for each row of `token_ids` (`[num_requests, width]`, row i's history its first
    `num_tokens[i]` tokens): `([num_requests, k]` int64 drafts, `[num_requests]` how many of each row are
    drafts)."""
    token_ids = np.asarray(token_ids)
    lengths = np.asarray(num_tokens, dtype=np.int64)
    num_requests = len(lengths)
    drafts = np.zeros((num_requests, k), dtype=np.int64)
    counts = np.zeros(num_requests, dtype=np.int64)
    if num_requests == 0 or k < 1:
        return drafts, counts
    width = min(token_ids.shape[1], int(lengths.max()))
    if width < 2:
        return drafts, counts
    tokens = token_ids[:, :width]
    last = tokens[np.arange(num_requests), np.maximum(lengths - 1, 0)]
    # A match ends at `end` (exclusive), 1 <= end <= length - 1, so that a token follows it; its last token
    # is tokens[end - 1], equal to the history's last.
    before_last = np.arange(width - 1)[None, :] < (lengths - 1)[:, None]
    rows, ends = np.nonzero((tokens[:, :-1] == last[:, None]) & before_last)
    ends = ends + 1
    run = np.ones(len(rows), dtype=np.int64)  # how many of the suffix's last tokens match before `end`
    alive = np.ones(len(rows), dtype=bool)
    row_lengths = lengths[rows]
    for n in range(2, max_n + 1):
        inside = alive & (ends - n >= 0)
        alive = inside & (tokens[rows, np.maximum(ends - n, 0)] == tokens[rows, np.maximum(row_lengths - n, 0)])
        run += alive
    best = np.zeros(num_requests, dtype=np.int64)
    np.maximum.at(best, rows, run)
    # np.nonzero lists a row's candidates by ascending end: the first at the row's best length is the
    # earliest occurrence.
    chosen = (run == best[rows]) & (best[rows] >= min_n)
    chosen_rows, first = np.unique(rows[chosen], return_index=True)
    if len(chosen_rows) == 0:
        return drafts, counts
    starts = ends[chosen][first]
    room = np.minimum(lengths[chosen_rows] - starts, max_model_len - lengths[chosen_rows])
    counts[chosen_rows] = np.clip(room, 0, k)
    offsets = np.minimum(starts[:, None] + np.arange(k)[None, :], width - 1)
    drafts[chosen_rows] = np.where(np.arange(k)[None, :] < counts[chosen_rows][:, None],
                                   tokens[chosen_rows[:, None], offsets], 0)
    return drafts, counts


class NgramProposer(Proposer):
    """`method: ngram`: drafts from the request's own history, no model (propose_ngram)."""

    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        super().__init__(config, context)
        # parse_speculative_config fills both bounds for ngram (vLLM's defaults when left out).
        self.min_n = config.prompt_lookup_min or 1
        self.max_n = config.prompt_lookup_max or self.min_n

    def propose(self, batch: ProposalBatch, num_speculative_tokens: int) -> DraftTokens:
        drafts, counts = propose_ngram(batch.token_ids, batch.num_tokens, k=num_speculative_tokens,
                                       min_n=self.min_n, max_n=self.max_n, max_model_len=self.context.max_model_len)
        return DraftTokens(token_ids=drafts, num_draft_tokens=counts)


__all__ = ["NgramProposer", "propose_ngram"]
