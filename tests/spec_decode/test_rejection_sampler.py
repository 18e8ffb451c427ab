"""The rejection sampler: greedy verification against a plain-Python reference, and, with temperature, top-k,
top-p and min-p, the emitted tokens' distribution equal to the target's (issue 37's acceptance 2).

The distribution test (`check_distribution`): a chi-square goodness-of-fit statistic over the tokens the target
can emit (cells with fewer than 5 expected draws merged), against the chi-square quantile at one-sided
probability 1e-6 (Wilson-Hilferty's approximation, z = 4.753), and no draw at all of a token the target gives
probability 0 (one top-k, top-p or min-p removed). The draws come from fixed seeds, so the test is deterministic;
`test_the_check_catches_a_wrong_resampling_rule` shows that at these sample sizes it fails the classic mistake
(redrawing from p instead of max(0, p - q) after a rejection).
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncengine.wire.engine_core import SamplingOptions
from asyncengine.worker.sampler import SamplingRow
from asyncengine.worker.spec_decode.rejection_sampler import (
    PLACEHOLDER,
    TargetDistributions,
    rejection_sample,
    request_generators,
    target_distributions,
)

VOCAB = 12
K = 3
TRIALS = 60_000
MIN_CONDITIONAL_DRAWS = 1_500
CRITICAL_Z = 4.753  # one-sided 1e-6


def chi_square_critical(df: int) -> float:
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + CRITICAL_Z * math.sqrt(h)) ** 3


def check_distribution(samples: torch.Tensor, p: torch.Tensor, what: str) -> None:
    """Fail unless `samples` (token ids) fit the distribution `p` [VOCAB] (module docstring)."""
    counts = torch.bincount(samples, minlength=VOCAB).double()
    impossible = (p == 0) & (counts > 0)
    assert not impossible.any(), f"{what}: drew tokens the target gives probability 0: {impossible.nonzero().tolist()}"
    expected = p.double() * len(samples)
    big = expected >= 5
    observed_cells = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    expected_cells = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    keep = expected_cells > 0
    statistic = float((((observed_cells - expected_cells) ** 2)[keep] / expected_cells[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 1, f"{what}: the target leaves one token; nothing to test"
    assert statistic < chi_square_critical(df), (f"{what}: chi-square {statistic:.1f} over {df} degrees of freedom "
                                                 f"(limit {chi_square_critical(df):.1f}), {len(samples)} draws")


def rows_of(options: SamplingOptions, count: int) -> list[SamplingRow]:
    return [SamplingRow(options=options, prompt_token_ids=[1], output_token_ids=[]) for _ in range(count)]


def position_logits(seed: int) -> torch.Tensor:
    """[K + 1, VOCAB] logits, one row per verified position."""
    return torch.randn((K + 1, VOCAB), generator=torch.Generator().manual_seed(seed)) * 1.5


OPTIONS = {
    "temperature": SamplingOptions(temperature=0.8),
    "top_k": SamplingOptions(temperature=1.0, top_k=4),
    "top_p": SamplingOptions(temperature=1.2, top_p=0.7),
    "min_p": SamplingOptions(temperature=0.9, min_p=0.15),
}


def verify_many(options: SamplingOptions, logits: torch.Tensor, drafts: torch.Tensor,
                draft_probs: torch.Tensor | None, seed: int):
    """TRIALS requests, all with these target rows (computed once, then repeated); `drafts` [TRIALS, K]."""
    once = target_distributions(logits, rows_of(options, 1), [K])
    target = TargetDistributions(probs=once.probs.repeat(TRIALS, 1), argmax=once.argmax.repeat(TRIALS))
    out = rejection_sample(drafts, [K] * TRIALS, target, [False] * TRIALS, draft_probs=draft_probs,
                           generator=torch.Generator().manual_seed(seed))
    return out, target.probs[:K + 1]


def check_each_position(out, p: torch.Tensor, drafts: torch.Tensor, what: str) -> None:
    """Token j is distributed as p_j given that drafts 0..j-1 were kept (then t_i == d_i for i < j)."""
    tokens = out.token_ids
    reached = torch.ones(TRIALS, dtype=torch.bool)
    for j in range(K + 1):
        if j == 0 or int(reached.sum()) >= MIN_CONDITIONAL_DRAWS:
            check_distribution(tokens[reached, j], p[j], f"{what}, position {j} ({int(reached.sum())} draws)")
        else:
            assert j >= 2, f"{what}: only {int(reached.sum())} draws reached position {j}"
        if j < K:
            reached &= tokens[:, j] == drafts[:, j]
    emitted = torch.tensor(out.num_emitted)
    assert (tokens[torch.arange(K + 1).unsqueeze(0) >= emitted.unsqueeze(1)] == PLACEHOLDER).all()


@pytest.mark.parametrize("name", list(OPTIONS))
def test_one_hot_drafts_keep_the_target_distribution(name):
    options = OPTIONS[name]
    logits = position_logits(1)
    p = target_distributions(logits, rows_of(options, 1), [K]).probs
    # Drafts as a lookup makes them: the likeliest token at each position but the second, whose draft the
    # target's filter removed (or its least likely token, where nothing is removed).
    draft = p.argmax(dim=1)[:K].clone()
    draft[1] = p[1].argmin()
    drafts = draft.repeat(TRIALS, 1)
    out, p = verify_many(options, logits, drafts, None, seed=2)
    check_each_position(out, p, drafts, f"{name}, one-hot drafts")


@pytest.mark.parametrize("name", list(OPTIONS))
def test_sampled_drafts_keep_the_target_distribution(name):
    options = OPTIONS[name]
    logits = position_logits(3)
    generator = torch.Generator().manual_seed(4)
    q = torch.softmax(torch.randn((K, VOCAB), generator=generator), dim=-1)
    drafts = torch.stack([torch.multinomial(q[j], TRIALS, replacement=True, generator=generator) for j in range(K)],
                         dim=1)
    out, p = verify_many(options, logits, drafts, q.repeat(TRIALS, 1), seed=5)
    check_each_position(out, p, drafts, f"{name}, drafts drawn from q")


def test_the_check_catches_a_wrong_resampling_rule():
    options = OPTIONS["temperature"]
    p = target_distributions(position_logits(1), rows_of(options, 1), [K]).probs[0]
    draft = int(p.argmax())
    # Accept with p(d), else redraw from p itself: the draft's token then comes up p(d) + (1 - p(d)) p(d).
    wrong = p * (1 - p[draft])
    wrong[draft] += p[draft]
    samples = torch.multinomial(wrong, TRIALS, replacement=True, generator=torch.Generator().manual_seed(6))
    with pytest.raises(AssertionError, match="chi-square"):
        check_distribution(samples, p, "the wrong rule")


def test_seeded_requests_over_many_seeds_and_independent_of_the_batch():
    options = [SamplingOptions(temperature=1.0, top_p=0.9, seed=seed) for seed in range(4_000)]
    rows = [SamplingRow(options=o, prompt_token_ids=[1], output_token_ids=[5, 6]) for o in options]
    logits = position_logits(7)
    p = target_distributions(logits, rows[:1], [K]).probs
    drafts = p.argmax(dim=1)[:K].repeat(len(rows), 1)
    target = target_distributions(logits.repeat(len(rows), 1), rows, [K] * len(rows))
    out = rejection_sample(drafts, [K] * len(rows), target, [False] * len(rows), generators=request_generators(rows))
    check_distribution(out.token_ids[:, 0], p[0], "first token over 4,000 seeds")
    # The same request alone, or beside other requests, emits the same tokens.
    for index in (0, 17, 3_999):
        alone = rejection_sample(drafts[index:index + 1], [K], target_distributions(logits, rows[index:index + 1], [K]),
                                 [False], generators=request_generators(rows[index:index + 1]))
        assert alone.as_lists()[0] == out.as_lists()[index]
    # A different output position is a different draw.
    later = [SamplingRow(options=o, prompt_token_ids=[1], output_token_ids=[5, 6, 7]) for o in options[:200]]
    moved = rejection_sample(drafts[:200], [K] * 200, target_distributions(logits.repeat(200, 1), later, [K] * 200),
                             [False] * 200, generators=request_generators(later))
    assert moved.as_lists() != out.as_lists()[:200]


def greedy_reference(drafts: list[int], argmax: list[int]) -> list[int]:
    out = []
    for j, draft in enumerate(drafts):
        out.append(argmax[j])
        if draft != argmax[j]:
            return out
    return out + [argmax[len(drafts)]]


def test_greedy_keeps_the_matching_prefix_then_the_targets_token():
    generator = torch.Generator().manual_seed(8)
    for _ in range(30):
        counts = torch.randint(0, K + 1, (9,), generator=generator).tolist()
        positions = sum(counts) + len(counts)
        logits = torch.randn((positions, VOCAB), generator=generator)
        argmax = logits.argmax(dim=1)
        drafts = torch.randint(0, VOCAB, (len(counts), K), generator=generator)
        start = 0
        for i, n in enumerate(counts):  # most drafts agree with the target, as a good proposer's do
            agree = torch.rand(K, generator=generator) < 0.7
            drafts[i, :n] = torch.where(agree[:n], argmax[start:start + n], drafts[i, :n])
            start += n + 1
        rows = rows_of(SamplingOptions(temperature=0.0, top_k=3), len(counts))
        target = target_distributions(logits, rows, counts)
        out = rejection_sample(drafts, counts, target, [True] * len(counts))
        start, want = 0, []
        for i, n in enumerate(counts):
            want.append(greedy_reference(drafts[i, :n].tolist(), argmax[start:start + n + 1].tolist()))
            start += n + 1
        assert out.as_lists() == want
        assert out.num_accepted == [len(w) - 1 for w in want]


def test_mixed_batch_greedy_random_and_no_drafts():
    logits = position_logits(9)
    greedy = SamplingOptions(temperature=0.0)
    random_ = SamplingOptions(temperature=1.0, seed=11)
    rows = [SamplingRow(greedy, [1], []), SamplingRow(random_, [1], []), SamplingRow(greedy, [1], [])]
    counts = [K, K, 0]
    stacked = torch.cat([logits, logits, logits[:1]])
    target = target_distributions(stacked, rows, counts)
    argmax = logits.argmax(dim=1)
    drafts = torch.stack([argmax[:K], argmax[:K], torch.zeros(K, dtype=torch.long)])
    out = rejection_sample(drafts, counts, target, [True, False, True], generators=request_generators(rows))
    lists = out.as_lists()
    assert lists[0] == argmax.tolist()  # all kept, then the bonus
    assert lists[2] == [int(argmax[0])]  # no drafts: the target's own token
    assert 1 <= len(lists[1]) <= K + 1
    # The seeded random request alone gives the same tokens.
    alone = rejection_sample(drafts[1:2], [K], target_distributions(logits, rows[1:2], [K]), [False],
                             generators=request_generators(rows[1:2]))
    assert alone.as_lists()[0] == lists[1]


def test_target_distributions_use_the_samplers_filters():
    logits = position_logits(10)
    rows = rows_of(SamplingOptions(temperature=0.7, top_k=3), 1)
    target = target_distributions(logits, rows, [K])
    assert ((target.probs > 0).sum(dim=1) == 3).all()
    assert torch.equal(target.argmax, logits.argmax(dim=1))
    torch.testing.assert_close(target.probs.sum(dim=1), torch.ones(K + 1))
    with pytest.raises(ValueError, match="4 rows of logits for 3 verified positions"):
        target_distributions(logits, rows, [2])
