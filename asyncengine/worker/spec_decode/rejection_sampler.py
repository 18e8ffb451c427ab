"""The rejection sampler: which drafted tokens a request keeps, and the token the target adds after them.

The target scores request i's `n_i` drafts in one forward, giving `n_i + 1` distributions: position j's
is the target's next-token distribution after the history and drafts `0..j-1`, the last one after all
of them. Verification, per request, is exact (Leviathan et al. 2023; Chen et al. 2023; vLLM's):
- greedy: drafts are kept while each equals the target's argmax; the first that differs is replaced by
  the argmax, and when all are kept the argmax of the last position is added (the bonus token). The
  tokens are those the target alone would choose, step after step;
- random: draft x at position j is kept with probability min(1, p_j(x) / q_j(x)), p the target's and q
  the draft's distribution (one-hot on x for a proposer without draft probabilities: a lookup, a greedy
  draft); at the first rejection the token is drawn from normalize(max(0, p_j - q_j)) instead, and when
  all are kept the bonus is drawn from p_n. Each emitted token is then distributed as p would draw it.

`p` is the target's distribution after the engine's sampling steps: `target_distributions` applies the
temperature, min_p, top_k and top_p through the worker sampler's own code (sampler.py); the steps before
the temperature (penalties, logit controls, logits processors, min_tokens) are the caller's, per position,
since each position's history holds the drafts before it.

Draws: a request with a seed draws from its own generator (`request_generators`: seeded by the seed and
the output position, as the sampler seeds its draws), first its uniforms, then the exponential race of
its one drawn token; the others draw from the engine's generator. A seeded request's tokens therefore do
not depend on the batch; they do differ from its tokens without speculation (other draws, same
distribution), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncengine.worker.sampler import SamplingRow, apply_min_p_top_k_top_p, row_generator_seed

PLACEHOLDER = -1  # the token id of an output slot past a request's emitted tokens


@dataclass
class TargetDistributions:
    """The target's scores at every verified position, request after request (`n_i + 1` rows each):
    `probs` `[num_positions, vocab]` float32, what a random request draws from; `argmax` `[num_positions]`,
    what a greedy request takes (the argmax of the logits, as the sampler takes it, not of `probs`)."""

    probs: torch.Tensor
    argmax: torch.Tensor


@dataclass
class RejectionOutput:
    """`token_ids` `[num_requests, max_drafts + 1]`: row i's first `num_emitted[i]` are its new tokens
    (kept drafts, then the target's token), the rest PLACEHOLDER; `num_accepted[i]` = `num_emitted[i] - 1`
    drafts were kept (what the acceptance counters count)."""

    token_ids: torch.Tensor
    num_emitted: list[int]

    @property
    def num_accepted(self) -> list[int]:
        return [n - 1 for n in self.num_emitted]

    def as_lists(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.token_ids, self.num_emitted)]


def _per_position(rows: list[SamplingRow], num_draft_tokens: list[int]) -> list[SamplingRow]:
    return [row for row, n in zip(rows, num_draft_tokens) for _ in range(n + 1)]


def target_distributions(logits: torch.Tensor, rows: list[SamplingRow],
                         num_draft_tokens: list[int]) -> TargetDistributions:
    """`logits` `[sum(n_i + 1), vocab]`: request i's positions in order, its steps before the temperature
    applied; `rows[i]` is request i's SamplingRow."""
    logits = logits.float()
    per_position = _per_position(rows, num_draft_tokens)
    if len(per_position) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(per_position)} verified positions "
                         f"(drafts per request {num_draft_tokens}, plus one each)")
    temperature = torch.tensor([1.0 if row.options.is_greedy else row.options.temperature for row in per_position],
                               dtype=torch.float32, device=logits.device)
    scaled = apply_min_p_top_k_top_p(logits / temperature.unsqueeze(1), per_position)
    return TargetDistributions(probs=torch.softmax(scaled, dim=-1), argmax=logits.argmax(dim=-1))


def request_generators(rows: list[SamplingRow], device: torch.device | str = "cpu") -> list[torch.Generator | None]:
    """A generator for each request with a seed (seeded at its output position), None for the others."""
    generators: list[torch.Generator | None] = []
    for row in rows:
        seed = row.options.seed
        if seed is None or row.options.is_greedy:
            generators.append(None)
        else:
            generators.append(torch.Generator(device=device).manual_seed(
                row_generator_seed(seed, len(row.output_token_ids))))
    return generators


def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: list[int], target: TargetDistributions,
                     is_greedy: list[bool], *, draft_probs: torch.Tensor | None = None,
                     generators: list[torch.Generator | None] | None = None,
                     generator: torch.Generator | None = None) -> RejectionOutput:
    """Verify each request's drafts.

    draft_token_ids: `[num_requests, max_drafts]` (row i's first `num_draft_tokens[i]` are drafts).
    target: the target's distributions, `sum(n_i + 1)` positions (`target_distributions`).
    draft_probs: `[sum(n_i), vocab]`, the distribution each draft was drawn from, request after request;
        None: each draft is one-hot (a lookup, a greedy draft).
    generators: per request, its own generator (`request_generators`) or None: `generator` (the engine's;
        None: torch's default) draws for it.
    """
    device = target.probs.device
    num_requests, max_drafts = draft_token_ids.shape
    vocab = target.probs.shape[1]
    counts = torch.tensor(num_draft_tokens, dtype=torch.long, device=device)
    if counts.numel() != num_requests or (counts < 0).any() or (counts > max_drafts).any():
        raise ValueError(f"num_draft_tokens {num_draft_tokens} does not fit {num_requests} requests of at most "
                         f"{max_drafts} drafts")
    starts = torch.cumsum(counts + 1, 0) - (counts + 1)  # each request's first position
    columns = torch.arange(max_drafts + 1, device=device)
    # [num_requests, max_drafts + 1]: the position of each column (clamped past a request's last one).
    positions = starts.unsqueeze(1) + torch.minimum(columns.unsqueeze(0), counts.unsqueeze(1))
    is_draft = columns[:max_drafts].unsqueeze(0) < counts.unsqueeze(1)
    drafts = torch.where(is_draft, draft_token_ids.to(device=device, dtype=torch.long), 0)
    greedy = torch.tensor(is_greedy, dtype=torch.bool, device=device)

    greedy_keep = drafts == target.argmax[positions[:, :max_drafts]]
    if greedy.all():
        keep = greedy_keep
        uniform = exponential = None
    else:
        uniform, exponential = _draws(num_requests, max_drafts, vocab, num_draft_tokens, is_greedy, generators,
                                      generator, device)
        p_draft = target.probs[positions[:, :max_drafts], drafts]
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
        else:
            draft_rows = (starts - torch.arange(num_requests, device=device)).unsqueeze(1) + columns[:max_drafts]
            draft_rows = torch.where(is_draft, draft_rows, 0)
            q_draft = draft_probs.float()[draft_rows, drafts]
        # u < p / q, written without dividing: q > 0 for any draft the proposer could have drawn.
        random_keep = uniform * q_draft < p_draft
        keep = torch.where(greedy.unsqueeze(1), greedy_keep, random_keep)
    keep &= is_draft
    num_accepted = torch.cumprod(keep.long(), dim=1).sum(dim=1)
    final_position = starts + num_accepted  # where the target's own token is taken

    next_token = target.argmax[final_position]
    if exponential is not None:
        p_final = target.probs[final_position]
        rejected = num_accepted < counts  # else the bonus: drawn from p itself
        if max_drafts == 0:  # nothing was drafted: every request draws its bonus from p
            q_final = torch.zeros_like(p_final)
        elif draft_probs is None:  # the rejected draft, one-hot
            rejected_draft = drafts.gather(1, num_accepted.clamp(max=max_drafts - 1).unsqueeze(1)).squeeze(1)
            q_final = torch.nn.functional.one_hot(rejected_draft, vocab).to(p_final.dtype)
        else:  # the rejected draft's row of draft_probs (request i's drafts start at row starts[i] - i)
            draft_row = final_position - torch.arange(num_requests, device=device)
            q_final = draft_probs.float()[draft_row.clamp(max=draft_probs.shape[0] - 1)]
        residual = torch.clamp(p_final - q_final, min=0.0)
        # p == q leaves nothing to resample; the rejection then had probability zero and came from
        # rounding, so p itself is drawn.
        empty = residual.sum(dim=1, keepdim=True) <= 0
        resample_from = torch.where(rejected.unsqueeze(1) & ~empty, residual, p_final)
        drawn = (resample_from / exponential).argmax(dim=1)
        next_token = torch.where(greedy, next_token, drawn)

    out = torch.full((num_requests, max_drafts + 1), PLACEHOLDER, dtype=torch.long, device=device)
    kept = columns[:max_drafts].unsqueeze(0) < num_accepted.unsqueeze(1)
    out[:, :max_drafts] = torch.where(kept, drafts, PLACEHOLDER)
    out.scatter_(1, num_accepted.unsqueeze(1), next_token.unsqueeze(1))
    return RejectionOutput(token_ids=out, num_emitted=(num_accepted + 1).tolist())


def _draws(num_requests: int, max_drafts: int, vocab: int, num_draft_tokens: list[int], is_greedy: list[bool],
           generators: list[torch.Generator | None] | None, generator: torch.Generator | None,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms `[num_requests, max_drafts]` and exponentials `[num_requests, vocab]`: the engine's generator
    for every row at once, then each seeded request's own generator over its row (its drafts' uniforms
    first, then its race)."""
    uniform = torch.rand((num_requests, max_drafts), generator=generator, device=device)
    exponential = torch.empty((num_requests, vocab), device=device).exponential_(generator=generator)
    for index, own in enumerate(generators or ()):
        if own is None or is_greedy[index]:
            continue
        count = num_draft_tokens[index]
        if count:
            uniform[index, :count] = torch.rand(count, generator=own, device=device)
        exponential[index].exponential_(generator=own)
    return uniform, exponential


__all__ = ["PLACEHOLDER", "RejectionOutput", "TargetDistributions", "rejection_sample", "request_generators",
           "target_distributions"]
