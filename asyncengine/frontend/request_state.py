"""RequestRecord and RequestTable: one object per request in the AsyncEngine, owning its life cycle.

One table for every kind of request: a generation (its `n` completions), a pooling request (one
prefill-only engine-core request), and whatever kind comes next. A kind differs only in what it makes
of its engine-core outputs: its RequestOutputs (generation: output_processor.py's RequestOutputState,
which detokenizes and finds stop strings; pooling: pooling.py's PoolingOutputs). Everything else is the
table's, the same for every kind.

A request is queued (waiting at the admission gate for a place under `max_waiting_requests`), then
in the engine core (its engine-core requests sent), and it ends once: finished, aborted, or failed.
Its record holds everything the frontend knows about it: its engine-core requests, its outputs' state,
the mailbox its consumer reads, which of its engine-core requests still hold an admission place (until
the scheduler first runs them) and which are still in the engine core (so that an abort reaches only
those).

The RequestTable holds the records by request id and their completions by engine-core id, and makes
each event one call: `open` (submit), `admit` and `send` (admission, then the hand-over to the
engine core), `abort`, `on_step` (the output handler), `fail_all` (the engine died). A record's
`end` removes it from both indexes, gives its admission places back and tells the stats, so that
no path forgets one of them.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import anyio

from asyncengine.errors import EngineOverloadedError, RequestError
from asyncengine.frontend.admission import AdmissionGate
from asyncengine.frontend.iteration_stats import StatsTracker
from asyncengine.frontend.output_collector import OutputCollector
from asyncengine.wire.engine_core import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest


class RequestOutputs(ABC):
    """What one kind of request makes of its engine-core outputs; the table calls these for every kind."""

    # Whether the stat loggers track its engine-core requests (prompt and generated tokens, latencies).
    counted_in_stats: ClassVar[bool] = True
    # One per engine-core request, in order; each has `core_request_id` and `finished`.
    completions: list[Any]
    num_cached_tokens: int

    @property
    @abstractmethod
    def finished(self) -> bool:
        """Every completion has finished."""

    @abstractmethod
    def failure(self, output: EngineCoreOutput) -> BaseException | None:
        """The error that `output` (a finished one) ends the whole request with, or None."""

    @abstractmethod
    def apply(self, completion: Any, output: EngineCoreOutput) -> bool:
        """Fold one engine-core output into its completion; True when the frontend ended the completion
        here (a stop string), so that the engine core must abort it."""

    @abstractmethod
    def make_output(self) -> Any | None:
        """The consumer's output after this step's outputs were applied, or None (nothing to hand over)."""

    @abstractmethod
    def abort(self) -> Any:
        """End the unfinished completions as aborted: the consumer's last output, or the exception it
        gets instead (a kind whose outputs cannot say "aborted")."""


class RequestPhase(enum.Enum):
    QUEUED = "queued"  # registered, waiting for admission; nothing sent to the engine core yet
    IN_CORE = "in core"  # its engine-core requests were sent
    FINISHED = "finished"  # every completion finished; the last output is in the mailbox
    ABORTED = "aborted"
    FAILED = "failed"  # an engine error (a worker refused it, or the engine died)


class RequestRecord:
    """One request, from `submit` to its end. Its consumer reads `next_output()`."""

    __slots__ = ("request_id", "core_requests", "outputs", "phase", "holding_places", "in_core", "mailbox")

    def __init__(self, request_id: str, core_requests: list[EngineCoreRequest], outputs: RequestOutputs) -> None:
        self.request_id = request_id
        self.core_requests = core_requests
        self.outputs = outputs
        self.phase = RequestPhase.QUEUED
        # Engine-core ids that hold an admission place (admitted at the gate, not yet run by the
        # scheduler), and those sent and not yet finished in the engine core.
        self.holding_places: set[str] = set()
        self.in_core: set[str] = set()
        self.mailbox = OutputCollector()

    @property
    def num_places(self) -> int:
        return len(self.core_requests)

    @property
    def is_open(self) -> bool:
        return self.phase is RequestPhase.QUEUED or self.phase is RequestPhase.IN_CORE

    async def next_output(self) -> Any:
        """The next output (merged with any the consumer has not taken yet); raises the request's error."""
        return await self.mailbox.get()


class RequestTable:
    """The requests an AsyncEngine is serving, by request id and by engine-core id."""

    def __init__(self, max_waiting_requests: int, stats: StatsTracker, stats_enabled: Callable[[], bool]) -> None:
        self.gate = AdmissionGate(max_waiting_requests)
        # The stat loggers' tracker, fed only while there is a logger (`stats_enabled()`).
        self._stats = stats
        self._stats_enabled = stats_enabled
        self._records: dict[str, RequestRecord] = {}
        self._by_core_id: dict[str, tuple[RequestRecord, Any]] = {}  # the record and its completion
        self._emptied = anyio.Event()
        self._emptied.set()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def request_ids(self) -> list[str]:
        return list(self._records)

    async def wait_empty(self) -> None:
        """Until no request is being served (each finished, was aborted or failed)."""
        await self._emptied.wait()

    # -- a request's life -------------------------------------------------------------------------------

    def open(self, request_id: str, core_requests: list[EngineCoreRequest], outputs: RequestOutputs) -> RequestRecord:
        """Register a request of any kind: its engine-core requests (one per completion of `outputs`) and
        what makes its outputs. Its id is taken from now on, so it can be aborted while it waits."""
        if request_id in self._records:
            raise RequestError(f"request id {request_id!r} is already in use", field="request_id")
        record = RequestRecord(request_id, core_requests, outputs)
        if not self._records:
            self._emptied = anyio.Event()
        self._records[request_id] = record
        for completion in record.outputs.completions:
            self._by_core_id[completion.core_request_id] = (record, completion)
        return record

    async def admit(self, record: RequestRecord, *, nowait: bool) -> bool:
        """Take the request's places at the gate (waiting for them unless `nowait`, which raises
        EngineOverloadedError when they are taken). False when it was aborted before it got in."""
        places = record.num_places
        if nowait:
            if not self.gate.try_enter(places):
                raise EngineOverloadedError(
                    f"{self.gate.capacity} requests are already waiting (max_waiting_requests); retry later"
                )
            admitted = True
        else:
            admitted = await self.gate.enter(places, lambda: record.is_open)
        if admitted and not record.is_open:
            self.gate.leave(places)  # aborted at the very moment it got in
            return False
        if admitted:  # from here on, ending the request gives the places back
            record.holding_places.update(request.request_id for request in record.core_requests)
        return admitted

    def send(self, record: RequestRecord) -> list[EngineCoreRequest]:
        """The request goes to the engine core now: its engine-core requests, to send."""
        core_requests = record.core_requests
        record.phase = RequestPhase.IN_CORE
        record.in_core.update(request.request_id for request in core_requests)
        if record.outputs.counted_in_stats and self._stats_enabled():
            self._stats.add_requests(core_requests)
        return core_requests

    def abort(self, record: RequestRecord, *, notify: bool) -> list[str]:
        """End an open request with finish_reason "abort" (its consumer gets that last output when
        `notify`); the engine-core ids to abort in the engine core. Nothing for an ended record."""
        if not record.is_open:
            return []
        unfinished = [c.core_request_id for c in record.outputs.completions if not c.finished]
        final = record.outputs.abort() if notify else None
        sent = [core_id for core_id in unfinished if core_id in record.in_core]
        self._end(record, RequestPhase.ABORTED)
        if self._stats_enabled():
            self._stats.abort(unfinished, time.monotonic())
        if isinstance(final, BaseException):
            record.mailbox.fail(final)
        elif final is not None:
            record.mailbox.put(final)
        self.gate.wake()  # it may be waiting for admission: let it see it was aborted
        return sent

    def abort_by_id(self, request_id: str, *, notify: bool) -> list[str]:
        record = self._records.get(request_id)
        return [] if record is None else self.abort(record, notify=notify)

    def on_step(self, message: EngineCoreOutputs) -> list[str]:
        """Fold one engine step's outputs into their requests and hand each request its output.
        Returns the engine-core ids to abort there: completions a stop string ended in the frontend,
        and the other completions of a request that failed in the engine."""
        released = self._release(message.admitted_request_ids)
        to_abort: list[str] = []
        touched: dict[str, RequestRecord] = {}
        for output in message.outputs:
            entry = self._by_core_id.get(output.request_id)
            if entry is None:
                continue  # aborted in the frontend while the step ran
            record, completion = entry
            outputs = record.outputs
            if output.finish_reason is not None and (error := outputs.failure(output)) is not None:
                # A worker refused it (or it ended with nothing to show): the request alone fails.
                record.in_core.discard(output.request_id)
                to_abort.extend(record.in_core)
                touched.pop(record.request_id, None)
                self._end(record, RequestPhase.FAILED)
                record.mailbox.fail(error)
                continue
            outputs.num_cached_tokens = output.num_cached_tokens
            if outputs.apply(completion, output):
                to_abort.append(completion.core_request_id)
            if completion.finished:
                core_id = completion.core_request_id
                del self._by_core_id[core_id]
                record.in_core.discard(core_id)
                if core_id in record.holding_places:
                    record.holding_places.discard(core_id)
                    released += 1
            touched[record.request_id] = record
        for record in touched.values():
            request_output = record.outputs.make_output()
            if request_output is not None:
                record.mailbox.put(request_output)
            if record.outputs.finished:
                self._end(record, RequestPhase.FINISHED)
        if released:
            self.gate.leave(released)
        return to_abort

    def fail_core_requests(self, core_ids: Iterable[str], error: BaseException) -> None:
        """One data-parallel engine core died while others serve: the requests it held (by these
        engine-core ids; all completions of a request go to one engine core) fail with `error`."""
        records = {entry[0].request_id: entry[0] for core_id in core_ids
                   if (entry := self._by_core_id.get(core_id)) is not None}
        for record in records.values():
            unfinished = [c.core_request_id for c in record.outputs.completions if not c.finished]
            self._end(record, RequestPhase.FAILED)
            if self._stats_enabled():
                self._stats.abort(unfinished, time.monotonic())
            record.mailbox.fail(error)

    def fail_all(self, error: BaseException) -> list[str]:
        """The engine died (or shut down): every request fails with `error`, and nothing may wait at the
        gate any more. Returns the engine-core ids that were still in the engine core."""
        in_core = [core_id for record in self._records.values() for core_id in record.in_core]
        for record in self._records.values():
            record.phase = RequestPhase.FAILED
            record.mailbox.fail(error)
        self._records.clear()
        self._by_core_id.clear()
        self._stats.clear()
        self.gate.fail(error)
        self._emptied.set()
        return in_core

    # -- helpers -----------------------------------------------------------------------------------------

    def _end(self, record: RequestRecord, phase: RequestPhase) -> None:
        """Forget a request: its indexes, its admission places, its engine-core ids."""
        record.phase = phase
        if self._records.get(record.request_id) is record:
            del self._records[record.request_id]
        for completion in record.outputs.completions:
            self._by_core_id.pop(completion.core_request_id, None)
        if record.holding_places:
            self.gate.leave(len(record.holding_places))
            record.holding_places.clear()
        record.in_core.clear()
        if not self._records:
            self._emptied.set()

    def _release(self, core_ids: Iterable[str]) -> int:
        """Admission places given back by engine-core requests the scheduler has run."""
        released = 0
        for core_id in core_ids:
            entry = self._by_core_id.get(core_id)
            if entry is not None and core_id in entry[0].holding_places:
                entry[0].holding_places.discard(core_id)
                released += 1
        return released
