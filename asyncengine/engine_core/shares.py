"""A step's shares of slots and tokens between parent requests (docs/server.md, "Fairness"): the scheduler's
bookkeeping, described in its module docstring (engine_core/scheduler.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from asyncengine.engine_core.sequence import Sequence


class Shares:
    """One step's accounting of what each parent request's sequences hold and take.

    The slots are a hard share: a parent never runs more than `max_seqs` sequences at once, so a slot
    is always left for a request that arrives later. The token budget is held to its share only while
    some sequence that is not the parent's own is waiting (counted as the step goes: those admitted no
    longer wait), so a request alone in the engine prefills at the step's full budget.
    """

    def __init__(self, scheduler: Any) -> None:  # the Scheduler (which imports this module)
        self._parent_of = scheduler._parent_of
        self.max_seqs = max(1, scheduler.max_num_seqs // 2)
        self.max_tokens = max(1, scheduler.max_num_batched_tokens // 2)
        self.step_budget = scheduler.max_num_batched_tokens
        self.running = Counter(self._parent_of.get(seq.request_id) for seq in scheduler.running)
        self.waiting = Counter(self._parent_of.get(seq.request_id) for seq in scheduler.waiting)
        self.num_waiting = len(scheduler.waiting)
        self.tokens: Counter[str | None] = Counter()

    def _contended(self, parent: str | None) -> bool:
        return parent is not None and self.num_waiting > self.waiting[parent]

    def tokens_left(self, seq: Sequence) -> int:
        """How many tokens `seq` may still be scheduled this step under its parent's share."""
        parent = self._parent_of.get(seq.request_id)
        if not self._contended(parent):
            return self.step_budget  # no share applies: the step's budget is the bound
        return self.max_tokens - self.tokens[parent]

    def admission_tokens_left(self, seq: Sequence) -> int:
        """As `tokens_left`, and 0 once its parent holds its share of the slots (contended or not)."""
        parent = self._parent_of.get(seq.request_id)
        if parent is not None and self.running[parent] >= self.max_seqs:
            return 0
        return self.tokens_left(seq)

    def spend(self, seq: Sequence, num_tokens: int) -> None:
        self.tokens[self._parent_of.get(seq.request_id)] += num_tokens

    def admit(self, seq: Sequence, num_tokens: int) -> None:
        parent = self._parent_of.get(seq.request_id)
        self.running[parent] += 1
        self.waiting[parent] -= 1
        self.num_waiting -= 1
        self.spend(seq, num_tokens)
