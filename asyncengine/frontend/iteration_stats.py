"""Per-step request statistics for stat loggers: IterationStats, FinishedRequestStats, StatsTracker.

The AsyncEngine feeds a StatsTracker (only while it has stat loggers, so an engine without any pays
nothing): the engine-core requests it sends, each step's outputs as they arrive, and aborts. For each
step the tracker returns an IterationStats that the engine hands to every logger's `record`.

The unit is the engine-core request, one per completion: a request with `n=2` is two of them, each
with its own time to first token, finish reason and latency, and each counting the prompt's tokens
once (each one is prefilled on its own; the prefix cache may make that cheap). Times are
`time.monotonic()` seconds, measured in the frontend: when a request was processed (its arrival) and
when a step's outputs were received, so queueing in the frontend and the transport count too.
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

    @property
    def is_empty(self) -> bool:
        return not (self.num_prompt_tokens or self.num_generation_tokens or self.finished_requests)


@dataclass(slots=True)
class _Tracked:
    arrival_time: float
    num_prompt_tokens: int
    num_generation_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float = 0.0

    def finished(self, reason: str, now: float) -> FinishedRequestStats:
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=now - self.arrival_time,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            time_to_first_token=ttft,
        )


class StatsTracker:
    """The engine-core requests in flight, by id, and what their steps add up to."""

    def __init__(self) -> None:
        self._requests: dict[str, _Tracked] = {}
        # Aborts happen between steps; they are reported with the next stats handed out (a step's, or
        # `take_pending`'s when the engine is idle).
        self._pending: list[FinishedRequestStats] = []

    def __len__(self) -> int:
        return len(self._requests)

    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        """Start tracking engine-core requests, as they are sent to the engine core."""
        for request in requests:
            self._requests[request.request_id] = _Tracked(request.arrival_time, len(request.prompt_token_ids))

    def step(
        self, outputs: Iterable[EngineCoreOutput], now: float, *, stopped_in_frontend: Iterable[str] = ()
    ) -> IterationStats:
        """The stats of one step whose outputs arrived at `now`.

        `stopped_in_frontend`: engine-core ids a stop string ended in this step; the engine core does
        not know about stop strings (it is told to abort them), so they finish here with "stop".
        """
        stats = IterationStats(finished_requests=self._pending)
        self._pending = []
        requests = self._requests
        for output in outputs:
            tracked = requests.get(output.request_id)
            if tracked is None:
                continue  # not tracked: aborted or stopped while the step ran, or sent before any logger
            new_tokens = len(output.new_token_ids)
            if new_tokens:
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
                stats.finished_requests.append(tracked.finished(output.finish_reason, now))
        for request_id in stopped_in_frontend:
            tracked = requests.pop(request_id, None)
            if tracked is not None:
                stats.finished_requests.append(tracked.finished(FinishReason.STOP, now))
        return stats

    def abort(self, request_ids: Iterable[str], now: float) -> None:
        """Finish these engine-core requests with "abort" (unknown ids are ignored) and forget them."""
        for request_id in request_ids:
            tracked = self._requests.pop(request_id, None)
            if tracked is not None:
                self._pending.append(tracked.finished(FinishReason.ABORT, now))

    def take_pending(self) -> IterationStats | None:
        """The aborts not reported yet, as stats of their own (None when there are none)."""
        if not self._pending:
            return None
        stats = IterationStats(finished_requests=self._pending)
        self._pending = []
        return stats

    def clear(self) -> None:
        self._requests.clear()
        self._pending = []
