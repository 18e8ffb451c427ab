"""A logits processor for tests: bans `extra_args["ban"]` per request and records, at every apply,
which request each row holds and its output tokens so far (named by `extra_args["tag"]`).

Named by path (`support.recording_logits:RecordingBanProcessor`) through the `logits_processors`
option. Its records live in the class, so only in-process engines with the `uni` executor (the worker
on a thread of the test's own process) can be inspected this way.
"""

from __future__ import annotations

from typing import Any, ClassVar

from asyncengine.plugins_api import LogitsProcessor, MoveDirectionality


class RecordingBanProcessor(LogitsProcessor):
    # One entry per apply: per row in order, (tag, output token ids at that moment); plus the rows the
    # logits had, to compare with the rows the processor was told about.
    applies: ClassVar[list[tuple[int, list[tuple[Any, list[int]]]]]] = []

    def __init__(self, engine_config, device, is_pin_memory) -> None:
        super().__init__(engine_config, device, is_pin_memory)
        self.rows: dict[int, tuple[Any, list[int], list[int]]] = {}  # index -> (tag, ban, output ids)

    def update_state(self, batch_update) -> None:
        if batch_update is None:
            return
        for index, params, _prompt, output in batch_update.added:
            extra = params.extra_args or {}
            self.rows[index] = (extra.get("tag"), list(extra.get("ban", [])), output)
        for index in batch_update.removed:
            del self.rows[index]  # a KeyError here is a bookkeeping bug: it fails the step, loudly
        for source, target, direction in batch_update.moved:
            if direction is MoveDirectionality.SWAP:
                self.rows[source], self.rows[target] = self.rows[target], self.rows[source]
            else:
                self.rows[target] = self.rows.pop(source)

    def apply(self, logits):
        seen = [(self.rows[i][0], list(self.rows[i][2])) if i in self.rows else (None, None)
                for i in range(max(len(self.rows), logits.shape[0]))]
        type(self).applies.append((logits.shape[0], seen))
        for index, (_tag, ban, _output) in self.rows.items():
            if ban and index < logits.shape[0]:
                logits[index, ban] = float("-inf")
        return logits


class ArgmaxInvariantCounter(LogitsProcessor):
    """Counts its applies; says it never changes the argmax."""

    calls: ClassVar[int] = 0

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits):
        type(self).calls += 1
        return logits
