"""The target's hidden states a proposer reads (`Proposer.needs_target_hidden_states`: EAGLE, EAGLE-3), per
request, in the rows `ProposalBatch.hidden_states` / `num_hidden_states` describe.

Every forward gives a state per computed token. A request's rows reach the proposer at its next step that
samples: a prompt's chunks that do not sample yet (chunked prefill) are kept until its last chunk, so the head
gets every position its target computed; of a verification step's k + 1 rows, only those of the kept
positions (the accepted drafts and the token before them) are true. What was never computed here (a prefix
cache hit) is never given: the head attends over the positions it was given.

EAGLE-3 reads, instead of the final states, the residual stream entering chosen decoder layers (vLLM's aux
hidden states), concatenated in the proposer's order: forward pre-hooks on those layers take it as the
layer receives it (`hidden`, or `hidden + residual` where the previous layer left the addition to the next
norm, the llama family's layer signature).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from asyncengine.config.speculative import FIELD
from asyncengine.errors import ConfigError


class TargetStates:
    """One per worker whose proposer reads the target's states; `layers`: the proposer's
    `aux_hidden_state_layers` (empty: the final states)."""

    def __init__(self, target_model: Any, layers: Sequence[int]) -> None:
        self.layers = tuple(layers)
        self._captured: dict[int, torch.Tensor] = {}
        self._step: dict[str, torch.Tensor] = {}  # this step's rows of each scheduled request
        self._pending: dict[str, list[torch.Tensor]] = {}  # rows of steps that did not sample the request
        if self.layers:
            decoder_layers = getattr(getattr(target_model, "model", None), "layers", None)
            if decoder_layers is None or max(self.layers) >= len(decoder_layers):
                raise ConfigError(f"{FIELD}: the proposer reads the states entering the target's layers "
                                  f"{list(self.layers)}; the target ({type(target_model).__name__}) has no "
                                  "model.layers holding them", field=FIELD)
            for index in sorted(set(self.layers)):
                decoder_layers[index].register_forward_pre_hook(partial(self._capture, index), with_kwargs=True)

    def _capture(self, index: int, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden"]
        residual = args[1] if len(args) > 1 else kwargs.get("residual")
        self._captured[index] = hidden if residual is None else hidden + residual

    def take(self, final_hidden: torch.Tensor, scheduled: Mapping[str, int]) -> None:
        """After a step's forward: its rows (`scheduled`: request id -> tokens computed, in batch order).
        Rows of the step before that no sample used (a prompt chunk) wait for the request's next sample."""
        for request_id, rows in self._step.items():  # (a copy: the step's other rows are not kept alive)
            self._pending.setdefault(request_id, []).append(rows.clone())
        if self.layers:
            missing = [index for index in self.layers if index not in self._captured]
            if missing:
                raise RuntimeError(f"the target's layers {missing} did not run their hooks in this step's forward: "
                                   "the states entering them cannot be given to the proposer")
            states = torch.cat([self._captured[index] for index in self.layers], dim=-1)
            self._captured.clear()
        else:
            states = final_hidden
        ends = np.cumsum(list(scheduled.values())).tolist()
        self._step = {request_id: states[end - n:end]
                      for (request_id, n), end in zip(scheduled.items(), ends)}

    def rows(self, request_ids: Sequence[str],
             num_kept: Sequence[int | None] | None) -> tuple[torch.Tensor, np.ndarray]:
        """(`hidden_states`, `num_hidden_states`) for the requests that sampled this step; `num_kept[i]`: the
        true rows of request i's step (its accepted drafts + 1 after it verified drafts), None: all."""
        parts: list[torch.Tensor] = []
        counts = np.zeros(len(request_ids), dtype=np.int64)
        for i, request_id in enumerate(request_ids):
            own = self._pending.pop(request_id, [])
            step = self._step.pop(request_id, None)
            if step is not None:
                kept = None if num_kept is None else num_kept[i]
                own.append(step if kept is None else step[:kept])
            parts.extend(own)
            counts[i] = sum(len(part) for part in own)
        hidden = torch.cat(parts) if parts else torch.empty(0)
        return hidden, counts

    def forget(self, request_id: str) -> None:
        self._step.pop(request_id, None)
        self._pending.pop(request_id, None)


__all__ = ["TargetStates"]
