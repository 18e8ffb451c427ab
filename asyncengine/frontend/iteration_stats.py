"""Per-step request statistics for stat loggers: IterationStats, FinishedRequestStats, StatsTracker.

The AsyncEngine feeds a StatsTracker (only while it has stat loggers, so an engine without any pays
nothing): the engine-core requests it sends, each step's outputs as they arrive, and aborts. For each
step the tracker returns an IterationStats that the engine hands to every logger's `record`.

The unit is the engine-core request, one per completion: a request with `n=2` is two of them, each
with its own time to first token, finish reason and latency, and each counting the prompt's tokens
once (each one is prefilled on its own; the prefix cache may make that cheap). Times are
`time.monotonic()` seconds, measured in the frontend: when a request was processed (its arrival) and
when a step's outputs were received, so queueing in the frontend and the transport count too.

A request's phases, vLLM's: queued (arrival to the start of the step that first scheduled it),
prefill (that start to its first token), decode (first token to its end); inference is prefill plus
decode. The start of a step is placed on the frontend's clock as the arrival of its outputs less the
seconds the engine core says the step took (`EngineCoreOutputs.step_seconds`, a duration, so the two
processes' clocks never meet); the step is the one whose outputs first list the request as admitted,
or, for a tracker fed without those lists, the one that brought its first token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from asyncengine.wire.engine_core import EngineCoreOutput, EngineCoreRequest, FinishReason


class FinishedRequestStats(msgspec.Struct, kw_only=True):
    """One engine-core request that finished (stop, length) or was aborted."""

    finish_reason: str
    e2e_latency: float  # seconds from arrival to the step (or abort) that finished it
    num_prompt_tokens: int
    num_generation_tokens: int
    # None when it ended before its first token (an abort while waiting or prefilling).
    time_to_first_token: float | None = None
    # Its phases in seconds (module docstring); 0 for a phase it never reached.
    queued_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    inference_time: float = 0.0
    max_tokens: int | None = None  # the token limit it ran with (the frontend resolved an unset one)


class IterationStats(msgspec.Struct, kw_only=True):
    """What one engine step did, seen from the frontend."""

    # Prompt tokens of the requests whose first output token arrived in this step: the prefills it
    # completed (a chunked prefill counts once, in the step that finished it).
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # One per request whose first token arrived in this step.
    time_to_first_tokens: list[float] = msgspec.field(default_factory=list)
    # One per request that got tokens in this step after its first: the time since its previous ones.
    inter_token_latencies: list[float] = msgspec.field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = msgspec.field(default_factory=list)
    # One per request (prompt) sent since the previous stats: how many completions it asked for (`n`).
    n_params: list[int] = msgspec.field(default_factory=list)
    # One per request whose completions have all finished: the most tokens any of them generated.
    max_num_generation_tokens: list[int] = msgspec.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.num_prompt_tokens or self.num_generation_tokens or self.finished_requests
                    or self.n_params)


@dataclass(slots=True)
class _Group:
    """The engine-core requests of one prompt (its `n` completions), for max_num_generation_tokens."""

    num_unfinished: int
    max_generation_tokens: int = 0


@dataclass(slots=True)
class _Tracked:
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int
    group: _Group
    num_generation_tokens: int = 0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float = 0.0

    def finished(self, reason: str, now: float) -> FinishedRequestStats:
        arrival, scheduled, first = self.arrival_time, self.scheduled_time, self.first_token_time
        if scheduled is None:  # never ran: it waited all its life
            scheduled = now
        # A step's start is an estimate (module docstring): keep the phases ordered and non-negative.
        scheduled = min(max(scheduled, arrival), now)
        first = None if first is None else max(first, scheduled)
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=now - arrival,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            time_to_first_token=None if self.first_token_time is None else self.first_token_time - arrival,
            queued_time=scheduled - arrival,
            prefill_time=(now if first is None else first) - scheduled,
            decode_time=0.0 if first is None else now - first,
            inference_time=now - scheduled,
            max_tokens=self.max_tokens,
        )


class StatsTracker:
    """The engine-core requests in flight, by id, and what their steps add up to."""

    def __init__(self) -> None:
        self._requests: dict[str, _Tracked] = {}
        # Aborts happen between steps; they are reported with the next stats handed out (a step's, or
        # `take_pending`'s when the engine is idle).
        self._pending: list[FinishedRequestStats] = []
        self._pending_n: list[int] = []
        self._pending_max_generation: list[int] = []

    def __len__(self) -> int:
        return len(self._requests)

    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        """Start tracking engine-core requests, as they are sent to the engine core: those of one prompt
        (its `n` completions) together."""
        requests = list(requests)
        if not requests:
            return
        group = _Group(len(requests))
        self._pending_n.append(len(requests))
        for request in requests:
            self._requests[request.request_id] = _Tracked(request.arrival_time, len(request.prompt_token_ids),
                                                          request.sampling.max_tokens, group)

    def step(
        self, outputs: Iterable[EngineCoreOutput], now: float, *, stopped_in_frontend: Iterable[str] = (),
        admitted: Iterable[str] = (), step_seconds: float = 0.0,
    ) -> IterationStats:
        """The stats of one step whose outputs arrived at `now`.

        `stopped_in_frontend`: engine-core ids a stop string ended in this step; the engine core does
        not know about stop strings (it is told to abort them), so they finish here with "stop".
        `admitted`: the ids this step scheduled for the first time; `step_seconds`: how long the engine
        core took from scheduling the step to sending its outputs.
        """
        stats = self._take()
        requests = self._requests
        step_started = now - max(0.0, step_seconds)
        for request_id in admitted:
            tracked = requests.get(request_id)
            if tracked is not None and tracked.scheduled_time is None:
                tracked.scheduled_time = step_started
        for output in outputs:
            tracked = requests.get(output.request_id)
            if tracked is None:
                continue  # not tracked: aborted or stopped while the step ran, or sent before any logger
            new_tokens = len(output.new_token_ids)
            if new_tokens:
                if tracked.scheduled_time is None:
                    tracked.scheduled_time = step_started
                if tracked.first_token_time is None:
                    tracked.first_token_time = now
                    stats.num_prompt_tokens += tracked.num_prompt_tokens
                    stats.time_to_first_tokens.append(now - tracked.arrival_time)
                else:
                    stats.inter_token_latencies.append(now - tracked.last_token_time)
                tracked.last_token_time = now
                tracked.num_generation_tokens += new_tokens
                stats.num_generation_tokens += new_tokens
            if output.finish_reason is not None:
                del requests[output.request_id]
                self._finish(tracked, output.finish_reason, now, stats)
        for request_id in stopped_in_frontend:
            tracked = requests.pop(request_id, None)
            if tracked is not None:
                self._finish(tracked, FinishReason.STOP, now, stats)
        return stats

    @staticmethod
    def _finish(tracked: _Tracked, reason: str, now: float, stats: IterationStats) -> None:
        stats.finished_requests.append(tracked.finished(reason, now))
        group = tracked.group
        group.num_unfinished -= 1
        group.max_generation_tokens = max(group.max_generation_tokens, tracked.num_generation_tokens)
        if group.num_unfinished == 0:
            stats.max_num_generation_tokens.append(group.max_generation_tokens)

    def abort(self, request_ids: Iterable[str], now: float) -> None:
        """Finish these engine-core requests with "abort" (unknown ids are ignored) and forget them."""
        # Appended to the pending lists themselves, reported with the next stats.
        pending = IterationStats(finished_requests=self._pending,
                                 max_num_generation_tokens=self._pending_max_generation)
        for request_id in request_ids:
            tracked = self._requests.pop(request_id, None)
            if tracked is not None:
                self._finish(tracked, FinishReason.ABORT, now, pending)

    def take_pending(self) -> IterationStats | None:
        """The aborts (and new requests' `n`) not reported yet, as stats of their own (None when there
        are none)."""
        if not (self._pending or self._pending_n):
            return None
        return self._take()

    def _take(self) -> IterationStats:
        """Fresh stats holding what is pending."""
        stats = IterationStats(finished_requests=self._pending, n_params=self._pending_n,
                               max_num_generation_tokens=self._pending_max_generation)
        self._pending, self._pending_n, self._pending_max_generation = [], [], []
        return stats

    def clear(self) -> None:
        self._requests.clear()
        self._pending, self._pending_n, self._pending_max_generation = [], [], []
