"""A speculative proposer, method `ae_repeat_last`, registered by a general plugin.

`RepeatLastProposer` drafts, for each request, its last token repeated: `num_speculative_tokens` copies, or
`prompt_lookup_max` of them when speculative_config gives it (a plugin's method may read the lookup keys: the
engine checks only their shape). It pays only where the output repeats a token (a run of spaces, of digits);
the target verifies every draft, so it can change speed, never the output. It counts its calls, per process,
in `CALLS`; with AE_PLUGIN_RECORD naming a file, each call appends one JSON line there, `{"what": "propose",
"call", "requests", "drafts", "pid", "role"}`: the end-to-end test reads where it ran and how often.
It imports only asyncengine.plugins_api (and numpy), as every plugin should.
"""

from __future__ import annotations

import json
import os

import numpy as np

from asyncengine.plugins_api import DraftTokens, ProposalBatch, Proposer, current_process_role, register_proposer

__all__ = ["CALLS", "METHOD", "RepeatLastProposer", "register"]

METHOD = "ae_repeat_last"
CALLS = {"propose": 0, "drafts": 0}


class RepeatLastProposer(Proposer):
    """Drafts each request's last token, repeated."""

    def propose(self, batch: ProposalBatch, num_speculative_tokens: int) -> DraftTokens:
        count = min(num_speculative_tokens, self.config.prompt_lookup_max or num_speculative_tokens)
        rows = np.arange(len(batch))
        last = batch.token_ids[rows, batch.num_tokens - 1]
        token_ids = np.repeat(last[:, None], num_speculative_tokens, axis=1).astype(np.int64)
        # Never past max_model_len: a request of n tokens has room for max_model_len - n more.
        room = np.clip(self.context.max_model_len - batch.num_tokens, 0, None)
        num_draft_tokens = np.minimum(room, count).astype(np.int64)
        CALLS["propose"] += 1
        CALLS["drafts"] += int(num_draft_tokens.sum())
        path = os.environ.get("AE_PLUGIN_RECORD")
        if path:
            with open(path, "a", encoding="utf-8") as record:
                record.write(json.dumps({"what": "propose", "call": CALLS["propose"], "requests": len(batch),
                                         "drafts": int(num_draft_tokens.sum()), "pid": os.getpid(),
                                         "role": current_process_role()}) + "\n")
        return DraftTokens(token_ids=token_ids, num_draft_tokens=num_draft_tokens)


def register() -> None:
    register_proposer(METHOD, "ae_spec_decode_example:RepeatLastProposer")
