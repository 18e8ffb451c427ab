"""Greedy decoding with transformers, the reference our outputs are compared against."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

# Where transformers' top-2 logits are closer than this, a different argmax is a tie, not an error.
TIE_GAP = 1e-4


@dataclass
class Reference:
    token_ids: list[int]
    logits: list[torch.Tensor]  # per generated token, the float32 logits it was chosen from


def _cache_keyword(model: torch.nn.Module) -> str:
    # transformers >= 5.2x names the cache argument `cache`; earlier 5.x releases `past_key_values`.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], num_tokens: int) -> Reference:
    """Greedy decoding of one prompt alone (no padding), with a KV cache."""
    keyword = _cache_keyword(model)
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    logits = out.logits[0, -1].float()
    tokens, steps = [], []
    for _ in range(num_tokens):
        token = int(logits.argmax())
        tokens.append(token)
        steps.append(logits)
        cache = getattr(out, "cache", None) or out.past_key_values
        out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{keyword: cache})
        logits = out.logits[0, -1].float()
    return Reference(tokens, steps)


@dataclass
class Comparison:
    num_compared: int  # tokens compared (up to a tie, or all)
    tie: bool  # the sequences diverged where transformers' top-2 logits were within TIE_GAP
    max_logprob_error: float


def compare_greedy(ours: list[int], our_logprobs: list[dict[int, float]] | None, ref: Reference,
                   *, tie_gap: float = TIE_GAP) -> Comparison:
    """Compare our greedy tokens (and top-N logprobs) with the reference; raise on a real mismatch
    (a divergence where transformers' top-2 logits are `tie_gap` or more apart)."""
    max_error = 0.0
    for index, (token, ref_token) in enumerate(zip(ours, ref.token_ids)):
        ref_logprobs = torch.log_softmax(ref.logits[index], dim=-1)
        if our_logprobs is not None:
            for token_id, value in our_logprobs[index].items():
                max_error = max(max_error, abs(value - float(ref_logprobs[token_id])))
        if token != ref_token:
            top2 = ref.logits[index].topk(2).values
            gap = float(top2[0] - top2[1])
            if gap < tie_gap:
                return Comparison(index, True, max_error)
            raise AssertionError(
                f"greedy token {index} differs: ours {token}, transformers {ref_token} "
                f"(transformers' top-2 gap {gap:.3g} is not a tie); ours {ours}, reference {ref.token_ids}"
            )
    if len(ours) != len(ref.token_ids):
        raise AssertionError(f"generated {len(ours)} tokens, reference has {len(ref.token_ids)}")
    return Comparison(len(ours), False, max_error)


def check_greedy(completion, ref: Reference, parity_record: dict[str, int] | None = None, *,
                 max_logprob_error: float = 1e-3) -> Comparison:
    """`compare_greedy` of a CompletionOutput, its top-N logprobs within `max_logprob_error`, counted in the
    run's parity record (conftest.py's `parity_record`) when given."""
    result = compare_greedy(completion.token_ids, completion.logprobs, ref)
    assert result.max_logprob_error < max_logprob_error, f"top-5 logprobs differ by {result.max_logprob_error}"
    if parity_record is not None:
        parity_record["sequences"] += 1
        parity_record["tokens"] += result.num_compared
        parity_record["ties"] += int(result.tie)
    return result


@dataclass
class LowPrecisionComparison:
    """Our low-precision run and transformers' at the same precision, both measured against
    transformers in float32 on the same tokens (our generated sequence, teacher-forced)."""

    our_logprob_error: float  # max |ours - float32| over our top-N logprobs at every step
    their_logprob_error: float  # the same for transformers at our precision, on the same token ids
    our_top1_agreement: float  # fraction of steps where our greedy token is float32's argmax
    their_top1_agreement: float  # ... where transformers' argmax at our precision is float32's


@torch.inference_mode()
def compare_low_precision(prompts: list[list[int]], completions: list, float32_model: torch.nn.Module,
                          low_model: torch.nn.Module) -> LowPrecisionComparison:
    """Each completion (ours, with top-N logprobs) against `float32_model`, next to `low_model` (the same
    transformers model cast to our dtype): it judges our rounding by what the dtype itself costs."""
    ours_err = theirs_err = 0.0
    ours_agree = theirs_agree = steps = 0
    for prompt, completion in zip(prompts, completions):
        ids = list(prompt) + list(completion.token_ids)
        window = slice(len(prompt) - 1, len(ids) - 1)  # the positions that predict each generated token
        exact = torch.log_softmax(float32_model(input_ids=torch.tensor([ids])).logits[0, window].float(), -1)
        low = torch.log_softmax(low_model(input_ids=torch.tensor([ids])).logits[0, window].float(), -1)
        for step, (token, logprobs) in enumerate(zip(completion.token_ids, completion.logprobs)):
            for token_id, value in logprobs.items():
                ours_err = max(ours_err, abs(value - float(exact[step, token_id])))
                theirs_err = max(theirs_err, abs(float(low[step, token_id]) - float(exact[step, token_id])))
            best = int(exact[step].argmax())
            ours_agree += int(token == best)
            theirs_agree += int(int(low[step].argmax()) == best)
            steps += 1
    return LowPrecisionComparison(ours_err, theirs_err, ours_agree / steps, theirs_agree / steps)


# The bfloat16 rule. The two bfloat16 implementations round at different places (our decode attention
# accumulates in float32 and rounds its output once; transformers rounds scores and probabilities to
# bfloat16), and on random tiny models the top-2 logits are often closer than one bfloat16 rounding, so
# token-by-token identity with transformers' bfloat16 is not a rule either side could meet. Instead:
# our top-5 logprobs are within BF16_ERROR_FACTOR times transformers-bfloat16's own distance from
# float32 (plus BF16_ERROR_FLOOR), and our greedy tokens agree with float32's argmax at least as often
# as transformers-bfloat16's argmax does, less BF16_AGREEMENT_SLACK.
BF16_ERROR_FACTOR = 1.5
BF16_ERROR_FLOOR = 0.02
BF16_AGREEMENT_SLACK = 0.05


def assert_bfloat16_rule(result: LowPrecisionComparison) -> None:
    assert result.our_logprob_error <= BF16_ERROR_FACTOR * result.their_logprob_error + BF16_ERROR_FLOOR, result
    assert result.our_top1_agreement >= result.their_top1_agreement - BF16_AGREEMENT_SLACK, result
