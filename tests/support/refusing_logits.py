"""A logits processor for tests that refuses, in its worker-side `check_request`, every request whose
`extra_args` hold `"refuse": true` (with a ValueError, as a processor says "bad arguments"), and
leaves the logits of every other request alone.

Named by path (`support.refusing_logits:RefusingProcessor`) through the `logits_processors` option.
"""

from __future__ import annotations

from asyncengine.plugins_api import LogitsProcessor


class RefusingProcessor(LogitsProcessor):
    def check_request(self, params) -> None:
        if (params.extra_args or {}).get("refuse"):
            raise ValueError("this request asked to be refused (extra_args.refuse)")

    def update_state(self, batch_update) -> None:
        if batch_update is not None:
            for _index, params, _prompt, _output in batch_update.added:
                # A refused request never joins the batch: were it here, the step (and the engine) would fail.
                if (params.extra_args or {}).get("refuse"):
                    raise AssertionError("a refused request reached update_state")

    def apply(self, logits):
        return logits
