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


def compare_greedy(ours: list[int], our_logprobs: list[dict[int, float]] | None, ref: Reference) -> Comparison:
    """Compare our greedy tokens (and top-N logprobs) with the reference; raise on a real mismatch."""
    max_error = 0.0
    for index, (token, ref_token) in enumerate(zip(ours, ref.token_ids)):
        ref_logprobs = torch.log_softmax(ref.logits[index], dim=-1)
        if our_logprobs is not None:
            for token_id, value in our_logprobs[index].items():
                max_error = max(max_error, abs(value - float(ref_logprobs[token_id])))
        if token != ref_token:
            top2 = ref.logits[index].topk(2).values
            gap = float(top2[0] - top2[1])
            if gap < TIE_GAP:
                return Comparison(index, True, max_error)
            raise AssertionError(
                f"greedy token {index} differs: ours {token}, transformers {ref_token} "
                f"(transformers' top-2 gap {gap:.3g} is not a tie); ours {ours}, reference {ref.token_ids}"
            )
    if len(ours) != len(ref.token_ids):
        raise AssertionError(f"generated {len(ours)} tokens, reference has {len(ref.token_ids)}")
    return Comparison(len(ours), False, max_error)
