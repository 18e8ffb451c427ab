"""Logit controls: a request's `logit_bias`, `allowed_token_ids` and `bad_words`, applied to the batch's logits.

vLLM's semantics: the allowed-token mask and the bad words set the logits they exclude to -inf, the
bias is added to the logits of the tokens it names, all before penalties, temperature, min_p, top_k
and top_p (vLLM applies them as built-in logits processors, first in its sampler). They commute with
the structured-output bitmask, which the runner applies before the sampler: a logit at -inf stays
there whatever is added.

What is fixed for a request is built once, when it joins the worker (`RequestLogitControls.build`), on
the device: its bias as (token ids, values), and one boolean row over the vocabulary that blocks every
token outside `allowed_token_ids` and every single-token bad word (a one-token word is always banned).
Per step, `apply_logit_controls` takes the rows that have controls and applies them to the whole batch
in one masked fill and one indexed add. Only a bad word of several tokens needs the request's recent
tokens: its last token is banned when the tokens before it are the last ones generated (vLLM compares
them with the output, not the prompt), a comparison of a few ints per word in Python, then one indexed
fill for the batch. A batch where no request has controls never calls this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncengine.wire.engine_core import SamplingOptions


def has_logit_controls(options: SamplingOptions) -> bool:
    return options.logit_bias is not None or options.allowed_token_ids is not None or bool(options.bad_words_token_ids)


@dataclass(frozen=True)
class RequestLogitControls:
    """One request's controls, as tensors on the worker's device."""

    bias_ids: torch.Tensor | None  # long [k]
    bias_values: torch.Tensor | None  # float32 [k]
    blocked: torch.Tensor | None  # bool [vocab]: True where the logit is set to -inf every step
    # Bad words of two tokens or more: (the tokens before the last, as a tuple to compare with the output's
    # tail, the last token).
    sequences: tuple[tuple[tuple[int, ...], int], ...]

    @classmethod
    def build(cls, options: SamplingOptions, vocab_size: int, device: torch.device) -> RequestLogitControls | None:
        """None when the request sets none of them (it then costs nothing per step). The ids are
        checked by the frontend (SamplingParams and the InputProcessor's limits): each is below `vocab_size`."""
        if not has_logit_controls(options):
            return None
        bias_ids = bias_values = blocked = None
        if options.logit_bias:
            bias_ids = torch.tensor(list(options.logit_bias), dtype=torch.long, device=device)
            bias_values = torch.tensor(list(options.logit_bias.values()), dtype=torch.float32, device=device)
        single = [word[0] for word in options.bad_words_token_ids if len(word) == 1]
        if options.allowed_token_ids is not None or single:
            if options.allowed_token_ids is not None:
                blocked = torch.ones(vocab_size, dtype=torch.bool)
                blocked[list(options.allowed_token_ids)] = False
            else:
                blocked = torch.zeros(vocab_size, dtype=torch.bool)
            if single:
                blocked[single] = True
            blocked = blocked.to(device)
        sequences = tuple((tuple(word[:-1]), word[-1]) for word in options.bad_words_token_ids if len(word) > 1)
        return cls(bias_ids, bias_values, blocked, sequences)

    def banned_now(self, output_token_ids: list[int]) -> list[int]:
        """The last tokens of the multi-token bad words whose other tokens were just generated."""
        banned = []
        generated = len(output_token_ids)
        for prefix, last in self.sequences:
            n = len(prefix)
            if n <= generated and tuple(output_token_ids[generated - n:]) == prefix:
                banned.append(last)
        return banned


def apply_logit_controls(logits: torch.Tensor, controls: list[RequestLogitControls | None],
                         output_token_ids: list[list[int]]) -> torch.Tensor:
    """`logits` (float32, [rows, vocab], written in place) with each row's controls applied;
    `controls[i]` and `output_token_ids[i]` are row i's."""
    device = logits.device
    blocked_rows, blocked_masks = [], []
    bias_rows, bias_counts, bias_ids, bias_values = [], [], [], []
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    for row, control in enumerate(controls):
        if control is None:
            continue
        if control.blocked is not None:
            blocked_rows.append(row)
            blocked_masks.append(control.blocked)
        if control.bias_ids is not None and control.bias_values is not None:
            bias_rows.append(row)
            bias_counts.append(control.bias_ids.numel())
            bias_ids.append(control.bias_ids)
            bias_values.append(control.bias_values)
        if control.sequences:
            banned = control.banned_now(output_token_ids[row])
            banned_rows.extend([row] * len(banned))
            banned_ids.extend(banned)
    if blocked_rows:
        if len(blocked_rows) == logits.shape[0]:
            logits.masked_fill_(torch.stack(blocked_masks), float("-inf"))
        else:
            index = torch.tensor(blocked_rows, dtype=torch.long, device=device)
            logits[index] = logits[index].masked_fill(torch.stack(blocked_masks), float("-inf"))
    if banned_rows:
        logits[torch.tensor(banned_rows, dtype=torch.long, device=device),
               torch.tensor(banned_ids, dtype=torch.long, device=device)] = float("-inf")
    if bias_rows:
        # output_size given: the device need not be asked for the length (no wait on CUDA).
        rows = torch.repeat_interleave(torch.tensor(bias_rows, dtype=torch.long, device=device),
                                       torch.tensor(bias_counts, dtype=torch.long, device=device),
                                       output_size=sum(bias_counts))
        logits.index_put_((rows, torch.cat(bias_ids)), torch.cat(bias_values), accumulate=True)
    return logits
