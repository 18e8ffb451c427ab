"""Sampler unit tests on hand-made logits, against vLLM's (v1) sampling semantics.

Order of operations the tests pin down: raw logprobs first; min_tokens masks stop/EOS ids; penalties
(repetition over prompt+output, frequency/presence over output); greedy argmax; else temperature,
min_p, top_k, top_p, then a draw.

Penalty arithmetic is checked through the public call only: a greedy row whose target token's
penalized logit is compared with a reference token placed just below, then just above, the
hand-computed value. The argmax flips exactly there, so the value is pinned to within 2 * _EPS.

Distribution checks draw N rows in one batch and compare each token's empirical frequency f with its
expected probability p. f has standard error se = sqrt(p(1-p)/N); the tolerance is 5 se, a
two-sided deviation of probability ~6e-7 per token for a correct sampler, so over every token of
every distribution test here a false failure is below 1e-4 (and the samplers are seeded, so the
outcome is fixed anyway). A wrong temperature, a missing renormalization or a shifted nucleus moves
frequencies by far more than 5 se at N = 10000 (5 se <= 0.025 for any p; 20000 for temperature).
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncengine.wire.engine_core import SamplingOptions
from asyncengine.worker.sampler import Sampler, SamplingRow

# The sampler's draw is op "sample", run through the op providers: the platform must be resolved.
pytestmark = pytest.mark.usefixtures("cpu_platform")

CPU = torch.device("cpu")
N_DRAWS = 10_000  # per distribution check; 5 se <= 0.025 for any p
_EPS = 1e-3


def make_row(prompt=(0,), output=(), **options) -> SamplingRow:
    return SamplingRow(
        options=SamplingOptions(**options), prompt_token_ids=list(prompt), output_token_ids=list(output)
    )


def make_sampler(vocab: int = 8, seed: int = 0) -> Sampler:
    return Sampler(vocab, CPU, seed)


def batch_logits(row_logits, count: int) -> torch.Tensor:
    """`count` copies of one row, as a real (non-expanded) tensor."""
    return torch.as_tensor(row_logits, dtype=torch.float32).unsqueeze(0).repeat(count, 1)


def draw(row_logits, count: int, vocab: int, seed: int = 0, **options) -> list[int]:
    """`count` draws of one row (one SamplingRow object repeated: the sampler only reads rows)."""
    row = make_row(**options)
    return make_sampler(vocab, seed)(batch_logits(row_logits, count), [row] * count).token_ids


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def assert_matches_distribution(tokens: list[int], expected: torch.Tensor) -> None:
    """Each token's frequency is within 5 standard errors of its expected probability."""
    n = len(tokens)
    freq = frequencies(tokens, expected.numel())
    expected = expected.double()
    for token, (f, p) in enumerate(zip(freq.tolist(), expected.tolist())):
        if p == 0.0:
            assert f == 0.0, f"token {token} has probability 0 but was drawn {f * n:.0f} times"
            continue
        tolerance = 5 * math.sqrt(p * (1 - p) / n)
        assert abs(f - p) <= tolerance, f"token {token}: frequency {f:.4f}, expected {p:.4f} +- {tolerance:.4f}"


def random_logits(rows: int, vocab: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_is_argmax_per_row():
    logits = random_logits(64, 50, seed=1, scale=3.0)
    rows = [make_row(temperature=0.0) for _ in range(64)]
    out = make_sampler(50)(logits.clone(), rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None


def test_temperature_below_epsilon_is_greedy_and_at_epsilon_is_not():
    # vLLM: temperature < 1e-5 is greedy.
    logits = batch_logits([0.0, 0.1, 0.05, 0.0], 200)  # nearly flat: random rows spread out
    greedy = make_sampler(4)(logits.clone(), [make_row(temperature=1e-6) for _ in range(200)])
    assert set(greedy.token_ids) == {1}
    # At T = 1e-5 the row samples. On flat logits the argmax path would always give token 0.
    flat = batch_logits([0.0, 0.0, 0.0, 0.0], 200)
    sampled = make_sampler(4)(flat, [make_row(temperature=1e-5) for _ in range(200)])
    assert len(set(sampled.token_ids)) > 1


# --- penalties ----------------------------------------------------------------------------------

TARGET, REFERENCE, VOCAB = 3, 5, 8


def greedy_winner(target_logit: float, reference_logit: float, prompt, output, **penalties) -> int:
    logits = torch.full((1, VOCAB), -50.0)
    logits[0, TARGET] = target_logit
    logits[0, REFERENCE] = reference_logit
    row = make_row(prompt, output, temperature=0.0, **penalties)
    return make_sampler(VOCAB)(logits, [row]).token_ids[0]


@pytest.mark.parametrize(
    "logit, prompt, output, penalties, expected",
    [
        # repetition: positive logits are divided, negative multiplied, over prompt AND output
        (3.0, [TARGET], [], {"repetition_penalty": 2.0}, 1.5),
        (3.0, [1], [TARGET], {"repetition_penalty": 2.0}, 1.5),
        (-1.0, [TARGET], [], {"repetition_penalty": 2.0}, -2.0),
        (-1.0, [1], [TARGET, TARGET], {"repetition_penalty": 2.0}, -2.0),  # once, not per occurrence
        (3.0, [TARGET], [], {"repetition_penalty": 0.5}, 6.0),  # < 1 encourages
        (-2.0, [TARGET], [], {"repetition_penalty": 0.5}, -1.0),
        (3.0, [1, 2], [4], {"repetition_penalty": 2.0}, 3.0),  # unseen token untouched
        # frequency: minus penalty * count in the OUTPUT only
        (3.0, [1], [TARGET, TARGET, TARGET], {"frequency_penalty": 0.5}, 1.5),
        (3.0, [TARGET, TARGET, TARGET], [1], {"frequency_penalty": 0.5}, 3.0),
        (1.0, [1], [TARGET, TARGET], {"frequency_penalty": -1.0}, 3.0),
        # presence: minus penalty once if present in the OUTPUT only
        (3.0, [1], [TARGET, TARGET, TARGET], {"presence_penalty": 0.7}, 2.3),
        (3.0, [TARGET], [1], {"presence_penalty": 0.7}, 3.0),
        (0.0, [1], [TARGET], {"presence_penalty": -1.5}, 1.5),
        # all three: repetition first, then frequency and presence (vLLM's order)
        (3.0, [1], [TARGET, TARGET],
         {"repetition_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.25}, 0.75),
        (-1.5, [TARGET], [TARGET],
         {"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.5}, -4.0),
    ],
)
def test_penalty_arithmetic(logit, prompt, output, penalties, expected):
    # Reference just below the hand-computed value: the target must win; just above: it must lose.
    assert greedy_winner(logit, expected - _EPS, prompt, output, **penalties) == TARGET
    assert greedy_winner(logit, expected + _EPS, prompt, output, **penalties) == REFERENCE


def test_penalties_are_per_row():
    logits = torch.full((2, VOCAB), -50.0)
    logits[:, TARGET] = 3.0
    logits[:, REFERENCE] = 2.0
    rows = [
        make_row([TARGET], [TARGET], temperature=0.0, repetition_penalty=2.0),  # 3.0 -> 1.5 < 2.0
        make_row([TARGET], [TARGET], temperature=0.0),  # no penalties: 3.0 stays
    ]
    assert make_sampler(VOCAB)(logits, rows).token_ids == [REFERENCE, TARGET]


def test_penalties_apply_before_random_sampling():
    # Token 3 (logit 10) appears 6 times in the output; frequency 2.0 takes it to -2. top_k=1 makes
    # the random path deterministic: it must pick the penalized argmax (token 5, logit 0).
    logits = batch_logits([-9.0, -9.0, -9.0, 10.0, -9.0, 0.0, -9.0, -9.0], 50)
    rows = [make_row([1], [TARGET] * 6, temperature=1.0, top_k=1, frequency_penalty=2.0) for _ in range(50)]
    assert set(make_sampler(VOCAB)(logits, rows).token_ids) == {REFERENCE}


# --- min_tokens -----------------------------------------------------------------------------------

# eos 7 best, stop id 4 next, eos 2 next, token 1 the best ordinary token.
MIN_TOKENS_LOGITS = [0.0, 7.0, 8.0, 0.0, 9.0, 0.0, 0.0, 10.0]


@pytest.mark.parametrize("num_output, expected", [(0, 1), (1, 1), (2, 1), (3, 7), (5, 7)])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(num_output, expected):
    row = make_row([0], [5] * num_output, temperature=0.0, min_tokens=3, eos_token_ids=(2, 7), stop_token_ids=(4,))
    assert make_sampler()(batch_logits(MIN_TOKENS_LOGITS, 1), [row]).token_ids == [expected]


def test_min_tokens_zero_masks_nothing():
    row = make_row([0], [], temperature=0.0, min_tokens=0, eos_token_ids=(2, 7), stop_token_ids=(4,))
    assert make_sampler()(batch_logits(MIN_TOKENS_LOGITS, 1), [row]).token_ids == [7]


def test_min_tokens_with_ignore_eos_masks_only_stop_ids():
    # ignore_eos: the frontend sends no eos ids, so EOS is an ordinary token and may be drawn.
    row = make_row([0], [], temperature=0.0, min_tokens=3, eos_token_ids=(), stop_token_ids=(4,))
    assert make_sampler()(batch_logits(MIN_TOKENS_LOGITS, 1), [row]).token_ids == [7]
    row = make_row([0], [], temperature=0.0, min_tokens=3, eos_token_ids=(), stop_token_ids=(7,))
    assert make_sampler()(batch_logits(MIN_TOKENS_LOGITS, 1), [row]).token_ids == [4]


def test_min_tokens_masks_random_rows_and_only_the_rows_below_it():
    logits = batch_logits([0.0] * 8, 2000)  # uniform
    masked = [make_row([0], [1], min_tokens=2, eos_token_ids=(2, 7), stop_token_ids=(4,)) for _ in range(1000)]
    free = [make_row([0], [1, 1], min_tokens=2, eos_token_ids=(2, 7), stop_token_ids=(4,)) for _ in range(1000)]
    tokens = make_sampler()(logits, masked + free).token_ids
    assert set(tokens[:1000]) == {0, 1, 3, 5, 6}
    assert set(tokens[1000:]) == set(range(8))


def test_min_tokens_ignores_stop_ids_beyond_the_logits_width():
    row = make_row([0], [], temperature=0.0, min_tokens=3, eos_token_ids=(7, 1000), stop_token_ids=(4, 999))
    assert make_sampler()(batch_logits(MIN_TOKENS_LOGITS, 1), [row]).token_ids == [2]


# --- top_k ----------------------------------------------------------------------------------------


def test_top_k_one_is_greedy():
    logits = random_logits(2000, 50, seed=2)
    rows = [make_row(temperature=1.0, top_k=1)] * 2000
    assert make_sampler(50)(logits.clone(), rows).token_ids == logits.argmax(dim=-1).tolist()


# Shuffled so sorting is exercised; distinct values so the top-k set is unambiguous.
TOP_K_LOGITS = torch.tensor([0.3, 1.2, -0.5, 0.9, 0.0, 1.0, -1.0, 0.6, 0.1, -0.2])


def test_top_k_samples_only_the_top_k_with_renormalized_probabilities():
    k = 3
    tokens = draw(TOP_K_LOGITS, N_DRAWS, 10, top_k=k)
    top = set(TOP_K_LOGITS.topk(k).indices.tolist())
    assert set(tokens) == top  # never outside, and each of the top k drawn
    expected = torch.zeros(10)
    idx = list(top)
    expected[idx] = torch.softmax(TOP_K_LOGITS[idx], dim=0)
    assert_matches_distribution(tokens, expected)


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_off_keeps_every_token(top_k):
    tokens = draw(TOP_K_LOGITS, N_DRAWS, 10, top_k=top_k)
    assert_matches_distribution(tokens, torch.softmax(TOP_K_LOGITS, dim=0))


def test_top_k_at_least_vocab_keeps_every_token():
    assert set(draw(TOP_K_LOGITS, 2000, 10, top_k=10)) == set(range(10))
    assert set(draw(TOP_K_LOGITS, 2000, 10, top_k=1000)) == set(range(10))


# --- top_p ----------------------------------------------------------------------------------------

# Probabilities 0.05, 0.5, 0.1, 0.15, 0.2 (shuffled). Sorted: 0.5, 0.2, 0.15, 0.1, 0.05; mass before
# each: 0, 0.5, 0.7, 0.85, 0.95. No top_p used below sits on one of these boundaries.
TOP_P_PROBS = torch.tensor([0.05, 0.5, 0.1, 0.15, 0.2])
TOP_P_LOGITS = TOP_P_PROBS.log()


@pytest.mark.parametrize(
    "top_p, nucleus",
    [
        (1e-6, [1]),  # tiny p still keeps the top token
        (1e-40, [1]),  # a float32 subnormal ...
        (1e-46, [1]),  # ... and a value float32 rounds to 0: the top token alone, never garbage (issue 30)
        (0.6, [1, 4]),  # 0.5 < 0.6: the second token is needed to reach p
        (0.9, [1, 4, 3, 2]),
    ],
)
def test_top_p_samples_the_smallest_nucleus_reaching_p(top_p, nucleus):
    tokens = draw(TOP_P_LOGITS, N_DRAWS, 5, top_p=top_p)
    assert set(tokens) == set(nucleus)
    expected = torch.zeros(5)
    expected[nucleus] = TOP_P_PROBS[nucleus] / TOP_P_PROBS[nucleus].sum()
    assert_matches_distribution(tokens, expected)


@pytest.mark.parametrize("top_p, nucleus", [(0.3, [1]), (0.8, [1, 4, 3]), (1.0, [1, 4, 3, 2, 0])])
def test_top_p_never_samples_outside_the_nucleus(top_p, nucleus):
    assert set(draw(TOP_P_LOGITS, 3000, 5, top_p=top_p)) == set(nucleus)


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    # probs 0.4, 0.3, 0.2, 0.1. top_k=2 leaves 4/7, 3/7: with top_p=0.5 the mass before the second
    # token (4/7) reaches p, so only the top token stays (vLLM: top-p after the top-k mask).
    # Applied to the raw distribution, top_p=0.5 would also keep the second token (0.4 < 0.5).
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert set(draw(logits, 2000, 4, top_k=2, top_p=0.5)) == {0}
    assert set(draw(logits, 2000, 4, top_k=2, top_p=0.6)) == {0, 1}


# --- min_p ----------------------------------------------------------------------------------------

MIN_P_PROBS = torch.tensor([0.12, 0.4, 0.08, 0.25, 0.15])
MIN_P_LOGITS = MIN_P_PROBS.log()


def test_min_p_drops_tokens_below_min_p_times_the_max_probability():
    # threshold 0.5 * 0.4 = 0.2: keep 0.4 and 0.25
    tokens = draw(MIN_P_LOGITS, N_DRAWS, 5, min_p=0.5)
    assert set(tokens) == {1, 3}
    expected = torch.tensor([0.0, 0.4, 0.0, 0.25, 0.0]) / 0.65
    assert_matches_distribution(tokens, expected)


def test_min_p_applies_to_the_tempered_distribution():
    # vLLM applies min_p after temperature. At T=3 the distribution flattens and token 4 (p=0.15)
    # clears 0.5 * max; at T=1 it does not (0.15 < 0.2).
    temperature, min_p = 3.0, 0.5
    tempered = torch.softmax(MIN_P_LOGITS / temperature, dim=0)
    keep = tempered >= min_p * tempered.max()
    assert keep[4] and not (MIN_P_PROBS[4] >= min_p * MIN_P_PROBS.max())
    tokens = draw(MIN_P_LOGITS, N_DRAWS, 5, temperature=temperature, min_p=min_p)
    assert set(tokens) == set(keep.nonzero().flatten().tolist())
    assert_matches_distribution(tokens, torch.where(keep, tempered, 0.0) / tempered[keep].sum())


def test_min_p_one_keeps_only_the_most_likely_token():
    assert set(draw(MIN_P_LOGITS, 1000, 5, min_p=1.0)) == {1}


# --- temperature ----------------------------------------------------------------------------------

TEMPERATURE_LOGITS = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.0, 1.5, 0.2])


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_draws_follow_softmax_of_logits_over_t(temperature):
    tokens = draw(TEMPERATURE_LOGITS, 20_000, 8, seed=3, temperature=temperature)
    assert_matches_distribution(tokens, torch.softmax(TEMPERATURE_LOGITS / temperature, dim=0))


def test_seeded_draws_follow_the_distribution_across_seeds_and_across_positions():
    # The (seed, position) mixing must give independent-looking streams: 20000 distinct seeds at one
    # position, and one seed at 20000 positions, each reproduce softmax(logits / T).
    expected = torch.softmax(TEMPERATURE_LOGITS / 0.8, dim=0)
    across_seeds = [make_row(temperature=0.8, seed=s) for s in range(N_DRAWS)]
    tokens = make_sampler(8)(batch_logits(TEMPERATURE_LOGITS, N_DRAWS), across_seeds).token_ids
    assert_matches_distribution(tokens, expected)
    # Output lengths 0..N-1: a range stands in for each output list (without penalties the sampler
    # only takes its len()), which avoids building 200M list entries.
    across_positions = [
        SamplingRow(SamplingOptions(temperature=0.8, seed=77), [0], range(p))  # type: ignore[arg-type]
        for p in range(N_DRAWS)
    ]
    tokens = make_sampler(8)(batch_logits(TEMPERATURE_LOGITS, N_DRAWS), across_positions).token_ids
    assert_matches_distribution(tokens, expected)


# --- seeds ----------------------------------------------------------------------------------------

SEED_VOCAB = 50
SEED_LOGITS = random_logits(1, SEED_VOCAB, seed=4, scale=0.5)[0]  # fairly flat: draws spread out


def _seeded_token(rows: list[SamplingRow], index: int, sampler: Sampler | None = None) -> int:
    logits = batch_logits(SEED_LOGITS, len(rows))
    return (sampler or make_sampler(SEED_VOCAB))(logits, rows).token_ids[index]


def test_seeded_row_is_independent_of_batch_neighbours_order_and_engine_seed():
    seeded = make_row([0, 1], [9] * 5, temperature=1.0, seed=1234)
    alone = _seeded_token([seeded], 0)
    neighbours = [
        make_row(temperature=0.7),
        make_row(temperature=0.0),
        make_row(temperature=1.3, top_k=5),
        make_row(temperature=1.0, top_p=0.5),
        make_row(temperature=1.0, min_p=0.2, seed=99),
        make_row([3, 4], [4, 4], temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.4),
    ]
    assert _seeded_token(neighbours[:3] + [seeded] + neighbours[3:], 3) == alone
    assert _seeded_token([seeded] + neighbours[::-1], 0) == alone
    assert _seeded_token(neighbours + [seeded], len(neighbours)) == alone
    # A different engine seed, and a sampler whose global generator has already been used.
    used = make_sampler(SEED_VOCAB, seed=99)
    used(batch_logits(SEED_LOGITS, 100), [make_row() for _ in range(100)])
    assert _seeded_token([seeded], 0, sampler=used) == alone
    # Recomputation after preemption: same seed and position, fresh call -> same token.
    assert all(_seeded_token([seeded], 0) == alone for _ in range(5))


def test_seeded_rows_differ_by_position_and_by_seed():
    by_position = [make_row([0], [1] * p, seed=1234) for p in range(40)]
    tokens = make_sampler(SEED_VOCAB)(batch_logits(SEED_LOGITS, 40), by_position).token_ids
    # Each equals the same row sampled alone...
    assert tokens[:5] == [_seeded_token([row], 0) for row in by_position[:5]]
    # ...and 40 near-uniform draws over 50 tokens are far from constant (expected ~28 distinct).
    assert len(set(tokens)) >= 15
    by_seed = [make_row([0], [1] * 3, seed=s) for s in range(40)]
    assert len(set(make_sampler(SEED_VOCAB)(batch_logits(SEED_LOGITS, 40), by_seed).token_ids)) >= 15


def test_consecutive_seeds_are_not_shifted_copies_of_one_stream():
    # n > 1 children get seeds s, s+1, ...; a naive seed + position mix would make child 1 at
    # position p replay child 0 at position p + 1.
    child0 = [make_row([0], [1] * (p + 1), seed=500) for p in range(40)]
    child1 = [make_row([0], [1] * p, seed=501) for p in range(40)]
    sampler = make_sampler(SEED_VOCAB)
    tokens0 = sampler(batch_logits(SEED_LOGITS, 40), child0).token_ids
    tokens1 = sampler(batch_logits(SEED_LOGITS, 40), child1).token_ids
    assert sum(a == b for a, b in zip(tokens0, tokens1)) < 20


def test_seeded_extreme_seed_values_work():
    for seed in (0, -1, 2**63 - 1, 2**64 + 5, -(2**70)):
        row = make_row([0], [1], seed=seed)
        assert _seeded_token([row], 0) == _seeded_token([row], 0)


def test_unseeded_rows_vary_across_calls_and_rows():
    sampler = make_sampler(SEED_VOCAB, seed=5)
    rows = [make_row() for _ in range(64)]
    first = sampler(batch_logits(SEED_LOGITS, 64), rows).token_ids
    second = sampler(batch_logits(SEED_LOGITS, 64), rows).token_ids
    assert first != second
    assert len(set(first)) >= 15


def test_unseeded_stream_is_reproducible_from_the_engine_seed():
    rows = [make_row() for _ in range(64)]
    a = make_sampler(SEED_VOCAB, seed=5)(batch_logits(SEED_LOGITS, 64), rows).token_ids
    b = make_sampler(SEED_VOCAB, seed=5)(batch_logits(SEED_LOGITS, 64), rows).token_ids
    c = make_sampler(SEED_VOCAB, seed=6)(batch_logits(SEED_LOGITS, 64), rows).token_ids
    assert a == b
    assert a != c


# --- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_raw_with_the_chosen_token_first_then_top_n():
    vocab = 12
    raw = random_logits(6, vocab, seed=6, scale=2.0)
    # Row 0: greedy, min_tokens masks the raw argmax (an EOS id) and a repetition penalty is on, so
    # the chosen token is not the raw argmax; its logprobs must still be the raw ones.
    eos = int(raw[0].argmax())
    rows = [
        make_row([0, 1, 2], [], temperature=0.0, min_tokens=2, eos_token_ids=(eos,), repetition_penalty=1.7,
                 logprobs=3),
        make_row([0], [4, 4], temperature=0.5, top_k=4, frequency_penalty=1.0, logprobs=5),
        make_row([0], [], temperature=1.0),  # no logprobs
        make_row([0], [], temperature=0.0, logprobs=0),  # only the chosen token
        make_row([0], [], temperature=2.0, min_p=0.1, logprobs=1),
        make_row([0], [], temperature=0.0, logprobs=vocab),  # the whole vocabulary
    ]
    out = make_sampler(vocab)(raw.clone(), rows)
    expected = torch.log_softmax(raw, dim=-1)
    assert out.logprobs is not None and len(out.logprobs) == len(rows)
    assert out.logprobs[2] is None
    for index, row in enumerate(rows):
        n = row.options.logprobs
        if n is None:
            continue
        ids, values = out.logprobs[index]
        assert len(ids) == len(values) == 1 + n
        token = out.token_ids[index]
        assert ids[0] == token
        assert values[0] == pytest.approx(expected[index, token].item(), abs=1e-5)
        top_values, top_ids = expected[index].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert ids[1:] == top_ids.tolist()
        assert values[1:] == pytest.approx(top_values.tolist(), abs=1e-5)
        assert values[1:] == sorted(values[1:], reverse=True)
        assert all(math.isfinite(v) for v in values)
    # Row 0's chosen token is not the raw argmax, but the top-1 entry is, with its raw logprob.
    ids, values = out.logprobs[0]
    assert ids[0] != eos and ids[1] == eos
    assert values[1] == pytest.approx(expected[0, eos].item(), abs=1e-5)


def test_logprobs_none_when_no_row_asks():
    out = make_sampler()(random_logits(3, 8, seed=7), [make_row(), make_row(temperature=0.0), make_row(seed=1)])
    assert out.logprobs is None


def test_logprobs_of_half_precision_logits_match_float32_log_softmax():
    raw = random_logits(2, 8, seed=8).to(torch.bfloat16)
    out = make_sampler()(raw.clone(), [make_row(temperature=0.0, logprobs=2), make_row(logprobs=2)])
    expected = torch.log_softmax(raw.float(), dim=-1)
    assert out.token_ids[0] == int(raw[0].float().argmax())
    for index in range(2):
        ids, values = out.logprobs[index]
        assert values == pytest.approx(expected[index, ids].tolist(), abs=1e-5)


# --- mixed batches --------------------------------------------------------------------------------


def test_mixed_greedy_and_random_rows():
    vocab = 20
    logits = random_logits(40, vocab, seed=9, scale=0.3)  # flat-ish: random rows rarely hit the argmax
    rows = [make_row(temperature=0.0) if i % 2 == 0 else make_row(temperature=1.0) for i in range(40)]
    sampler = make_sampler(vocab, seed=10)
    argmax = logits.argmax(dim=-1).tolist()
    random_draws = []
    for _ in range(5):
        tokens = sampler(logits.clone(), rows).token_ids
        assert tokens[0::2] == argmax[0::2]
        random_draws.append(tuple(tokens[1::2]))
    assert len(set(random_draws)) == 5  # random rows differ call to call
    matches = sum(t == argmax[2 * i + 1] for draw in random_draws for i, t in enumerate(draw))
    assert matches < len(random_draws) * 20 / 2  # they are not secretly greedy


def test_sampler_does_not_modify_the_callers_logits():
    logits = batch_logits(MIN_TOKENS_LOGITS, 1)
    before = logits.clone()
    make_sampler()(logits, [make_row([0], [], temperature=0.0, min_tokens=2, eos_token_ids=(7,))])
    assert torch.equal(logits, before)
