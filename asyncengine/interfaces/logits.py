"""Batch-level logits processors (vLLM v1's design): the interface and the BatchUpdate a processor
receives. The worker's bookkeeping that produces the updates is asyncengine/worker/logits_processors.py.

Processors come from the entry-point group `asyncengine.logits_processors` and from the
`logits_processors` option. The frontend calls each class's `validate_params(params)` per request;
every worker builds one instance of each class when it loads the model and, before sampling a step,
calls `update_state(batch_update)` then `apply(logits)`. docs/logits_processors.md is the user-facing
description.

Rows. The logits a processor sees hold one row per request that samples this step (a request whose
prompt is still being prefilled in chunks, or that is not scheduled this step, has no row). A row
index is stable for as long as its request keeps sampling step after step: the worker keeps a
persistent layout, fills the rows freed by leaving requests with arriving ones, and closes the
remaining gaps by moving the last rows down (MoveDirectionality.UNIDIRECTIONAL). Processors apply a
BatchUpdate's `removed` and `added` (disjoint sets of indices, so in either order), then `moved` in
list order, exactly as vLLM's built-in processors do.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple


class LogitsProcessor:
    """Base class of batch-level logits processors. Subclass it and override the four methods.

    Built once per worker as `cls(engine_config, device, is_pin_memory)`. Every tensor-parallel rank
    builds its own instance and sees the same batches: keep the processing deterministic, so that
    every rank picks the same token.
    """

    def __init__(self, engine_config: Any, device: Any, is_pin_memory: bool) -> None:
        self.engine_config = engine_config
        self.device = device
        self.is_pin_memory = is_pin_memory

    @classmethod
    def validate_params(cls, params: Any) -> None:
        """Called in the frontend for every request, with its SamplingParams (per-request arguments
        are in `params.extra_args`): raise RequestError(message, field=...) to refuse the request."""

    def check_request(self, params: Any) -> None:
        """Called in the worker when a request joins it (its SamplingOptions, as `AddedRequest.params`
        will be), before the `update_state` that adds it. Raise to refuse that request alone: it ends
        with an error naming this processor (RequestError in the frontend), and the other requests and
        the engine go on, where an exception in `update_state` or `apply` fails the whole step.
        Build or check here whatever per-request state can fail."""

    def is_argmax_invariant(self) -> bool:
        """True when `apply` never changes the argmax of a row (it only reshapes the distribution,
        as min_p does): the worker then skips `apply` for steps where no request samples at random.
        Asked once, when the worker builds the processor."""
        return False

    def update_state(self, batch_update: "BatchUpdate | None") -> None:
        """What changed in the batch since the previous call (None: nothing). Called before every
        `apply`, also for steps whose `apply` is skipped."""
        raise NotImplementedError

    def apply(self, logits: Any) -> Any:
        """Return the processed logits, shape (batch_size, vocab), float32; may modify `logits` in place."""
        raise NotImplementedError


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # the request at a moves to b; a is empty afterwards
    SWAP = enum.auto()  # the requests at a and b trade places (not produced today; part of vLLM's shape)


class AddedRequest(NamedTuple):
    """A request that takes row `index` (a tuple, as in vLLM: `for index, params, prompt, output in added`)."""

    # vLLM's field name, which shadows tuple.index on purpose: plugins read `added.index`.
    index: int  # type: ignore[assignment]
    # The request's SamplingOptions: temperature, top_p, ..., extra_args (the request's own dict).
    params: Any
    prompt_token_ids: list[int]
    # The worker's running list of the request's output tokens: it grows by one token after each
    # step the request samples in, so a processor may keep a reference instead of copying it.
    output_token_ids: list[int]


class MovedRequest(NamedTuple):
    from_index: int
    to_index: int
    direction: MoveDirectionality


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the processor's previous `update_state` call.

    Read by logits processors in the worker. `removed` and `added` never share an index: a row
    freed by a leaving request and taken by an arriving one is only in `added`.
    """

    batch_size: int  # rows of the logits the next `apply` receives
    removed: Sequence[int]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


__all__ = ["AddedRequest", "BatchUpdate", "LogitsProcessor", "MoveDirectionality", "MovedRequest"]
