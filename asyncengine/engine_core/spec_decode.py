"""The scheduler's side of speculative decoding (docs/speculative_decoding.md): which of a request's drafts a
step verifies, and the acceptance counters vLLM reports.

The worker proposes drafts after each step that samples (ModelRunnerOutput.draft_token_ids); the scheduler
keeps them on the sequence and schedules the request's next step for 1 + k tokens: its last sampled token
and its k drafts (SchedulerOutput.spec_token_ids). Those k + 1 positions count as computed while the step
runs; when it comes back with a accepted drafts, the k - a rejected positions are rolled back and the
blocks that only they needed are freed (BlockManager.trim).

A speculating request's next step depends on how many of its drafts the step in flight accepts, so with
speculation a request never has two steps in flight: under async scheduling it sits out the schedule that
overlaps its own step (the other requests do not), and its next step carries the drafts proposed after
the step before it. The tokens are the same either way; what async scheduling still overlaps is the
engine core's work for the other requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncengine.engine_core.sequence import Sequence


def drafts_to_verify(seq: Sequence, *, num_new: int, budget: int, max_model_len: int,
                     constrained: bool) -> list[int]:
    """The drafts of `seq` its step verifies beside its one new token (`num_new` scheduled so far): none while
    it prefills or is constrained by a grammar (its masks are one per step: docs/speculative_decoding.md);
    else its drafts, cut to the step's `budget` left, to max_model_len and to its max_tokens (a step emits
    at most k + 1 tokens)."""
    drafts = seq.spec_token_ids
    if not drafts or num_new != 1 or constrained or seq.num_computed_tokens != seq.num_tokens - 1:
        return []
    room = min(budget - 1, max_model_len - seq.num_tokens - 1,
               seq.sampling.max_tokens - seq.num_output_tokens - 1)
    return drafts[:max(0, room)]


class SpecDecodeCounters:
    """vLLM's speculative counters, totals since the engine started (SchedulerStats.spec_decode_*)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_draft_tokens` drafts kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    def stats(self) -> dict[str, Any]:
        """The SchedulerStats fields these counters fill."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos)}
