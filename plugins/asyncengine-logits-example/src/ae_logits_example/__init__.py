"""BannedTokensProcessor: a batch-level logits processor that bans the token ids a request names.

Per request: `SamplingParams(extra_args={"banned_token_ids": [...]})`. It imports only
asyncengine.plugins_api, as every plugin should.
"""

from __future__ import annotations

import json
import os

from asyncengine.plugins_api import LogitsProcessor, MoveDirectionality, RequestError, current_process_role

__all__ = ["BannedTokensProcessor"]

FIELD = "extra_args.banned_token_ids"


def banned_token_ids(extra_args: dict | None) -> list[int] | None:
    """The request's banned ids, or None when it names none; RequestError when malformed."""
    if not extra_args or "banned_token_ids" not in extra_args:
        return None
    ids = extra_args["banned_token_ids"]
    if not isinstance(ids, list):
        raise RequestError(f"banned_token_ids must be a list of token ids, got {type(ids).__name__}", field=FIELD)
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise RequestError(f"banned_token_ids must hold non-negative integers, got {token_id!r}", field=FIELD)
    return ids


class BannedTokensProcessor(LogitsProcessor):
    def __init__(self, engine_config, device, is_pin_memory: bool) -> None:
        super().__init__(engine_config, device, is_pin_memory)
        self.banned: dict[int, list[int]] = {}  # batch row -> its request's banned ids
        self._recorded = False

    @classmethod
    def validate_params(cls, params) -> None:
        banned_token_ids(params.extra_args)

    def is_argmax_invariant(self) -> bool:
        return False  # banning the top token changes the argmax

    def update_state(self, batch_update) -> None:
        if batch_update is None:
            return
        for index, params, _prompt, _output in batch_update.added:
            ids = banned_token_ids(params.extra_args)  # checked in the frontend already
            if ids:
                self.banned[index] = ids
            else:  # the row's previous request may have had some
                self.banned.pop(index, None)
        for index in batch_update.removed:
            self.banned.pop(index, None)
        for source, target, direction in batch_update.moved:
            moving = self.banned.pop(source, None)
            if direction is MoveDirectionality.SWAP:
                staying = self.banned.pop(target, None)
                if staying is not None:
                    self.banned[source] = staying
            else:
                self.banned.pop(target, None)
            if moving is not None:
                self.banned[target] = moving

    def apply(self, logits):
        if not self._recorded:
            self._record()
        if not self.banned:
            return logits
        vocab = logits.shape[1]
        rows, columns = [], []
        for row, ids in self.banned.items():
            for token_id in ids:
                if token_id < vocab:  # the frontend cannot know the vocabulary: ignore the others
                    rows.append(row)
                    columns.append(token_id)
        if rows:
            logits[rows, columns] = float("-inf")
        return logits

    def _record(self) -> None:
        """Where the first apply ran, for the end-to-end test (only when AE_PLUGIN_RECORD is set)."""
        self._recorded = True
        path = os.environ.get("AE_PLUGIN_RECORD")
        if path:
            line = {"what": "logits processor apply", "pid": os.getpid(), "role": current_process_role()}
            with open(path, "a", encoding="utf-8") as record:
                record.write(json.dumps(line) + "\n")
