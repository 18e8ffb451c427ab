"""Data parallelism: `data_parallel_size` engine cores behind one frontend, as one CoreClient.

Each engine core has its own workers and KV cache (started exactly as a single engine core is: in this
event loop or in its own process, `in_process`). `DataParallelCoreClient` speaks the CoreClient protocol
to the AsyncEngine, so nothing above it knows there are several:

- `AddRequests` goes to the least loaded live engine core: fewest requests it holds (waiting + running,
  counted here as they are sent and finish, so a burst between two steps is seen at once), then the
  lower KV-cache usage of its last step, then the lower index. A request whose first prompt block was
  routed before goes back to that engine core (its prefix cache holds it) unless that one holds
  AFFINITY_SLACK requests more than the least loaded. All completions of one request (`n`) go together.
- `AbortRequests` reach the engine core that holds each id.
- `UtilityCall` goes to every live engine core and the answers are combined: `collective_rpc`'s lists are
  concatenated (engine 0's ranks first), `get_scheduler_stats` is summed (with each engine's own stats in
  `engines`, for /metrics' `engine` label), anything else answers with the first engine's result.
- A step's `EngineCoreOutputs` pass through with `scheduler_stats.engine_index` set.

An engine core that dies while another lives fails only its own requests: the client hands the
AsyncEngine an `EngineLost` (its index, the EngineDeadError, the engine-core ids it held), and routes no
more requests to it. When the last one dies, the death passes through as from a single engine core, so
the engine (and `serve`) end as they always do.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskStatus

from asyncengine.config.engine import EngineConfig
from asyncengine.errors import EngineDeadError
from asyncengine.frontend.core_client import CoreClient, start_core_client
from asyncengine.frontend.startup import FrontendSetup
from asyncengine.plugin_runtime.records import StartupTrace
from asyncengine.wire.engine_core import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from asyncengine.wire.messages import AbortRequests, AddRequests, EngineCoreDead, UtilityCall, UtilityResult

logger = logging.getLogger(__name__)

# A request goes to the engine core whose prefix cache has its first block, unless that one holds this
# many requests more than the least loaded: past that, waiting costs more than recomputing one block.
AFFINITY_SLACK = 4
AFFINITY_ENTRIES = 4096  # first blocks remembered (least recently routed forgotten first)
# Messages merged from the engine cores, waiting for the AsyncEngine's output handler (backpressure).
MERGED_BUFFER = 64


@dataclass(frozen=True)
class EngineLost:
    """In this process only (never on a wire): engine core `engine_index` died while others live; the
    requests it held (`core_request_ids`) fail with `error`."""

    engine_index: int
    error: EngineDeadError
    core_request_ids: list[str]


@dataclass(eq=False)
class _Engine:
    index: int
    client: CoreClient
    held: set[str] = field(default_factory=set)  # engine-core request ids sent and not finished
    kv_cache_usage: float = 0.0
    alive: bool = True


class Router:
    """Which engine core gets a request (pure bookkeeping, no I/O: tested on its own)."""

    def __init__(self, num_engines: int, block_size: int) -> None:
        self.loads = [0] * num_engines
        self.kv_usage = [0.0] * num_engines
        self.alive = [True] * num_engines
        self.block_size = block_size
        self._first_blocks: OrderedDict[tuple[int, ...], int] = OrderedDict()

    def choose(self, prompt_token_ids: list[int]) -> int:
        live = [i for i, alive in enumerate(self.alive) if alive]
        if not live:
            raise EngineDeadError("every data-parallel engine core is dead")
        least = min(live, key=lambda i: (self.loads[i], self.kv_usage[i], i))
        key = tuple(prompt_token_ids[: self.block_size]) if len(prompt_token_ids) >= self.block_size else None
        if key is not None:
            cached = self._first_blocks.get(key)
            if cached is not None and self.alive[cached] and self.loads[cached] <= self.loads[least] + AFFINITY_SLACK:
                least = cached
            self._first_blocks[key] = least
            self._first_blocks.move_to_end(key)
            if len(self._first_blocks) > AFFINITY_ENTRIES:
                self._first_blocks.popitem(last=False)
        return least


@dataclass(eq=False)
class _CombinedCall:
    """One UtilityCall of the AsyncEngine, asked of several engine cores."""

    call_id: int
    method: str
    results: dict[int, Any]  # engine index -> result, as they arrive
    waiting: set[int]  # engine indexes still to answer
    error: UtilityResult | None = None


class DataParallelCoreClient(CoreClient):
    def __init__(self, config: EngineConfig, clients: list[CoreClient]) -> None:
        super().__init__()
        self.config = config
        self.engines = [_Engine(index, client) for index, client in enumerate(clients)]
        self.router = Router(len(clients), config.block_size)
        self.process_name = f"{len(clients)} data-parallel engine cores"
        self._owner: dict[str, int] = {}  # engine-core request id -> engine index
        self._merged_send, self._merged = anyio.create_memory_object_stream[Any](MERGED_BUFFER)
        self._calls: dict[int, _CombinedCall] = {}  # by the id each engine core was given
        self._next_call_id = 0
        self._last_death: tuple[str, BaseException | None] = ("every data-parallel engine core stopped", None)
        self._closing = False
        self.lost: list[EngineLost] = []  # engine cores that died while others served on

    @classmethod
    async def serve(cls, config: EngineConfig, setup: FrontendSetup, plugins: Any, trace: StartupTrace, *,
                    task_status: TaskStatus[DataParallelCoreClient] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start `data_parallel_size` engine cores at once (each as `in_process` says), then
        `task_status.started(client)`; then merge their messages until every one has ended."""
        start_one = start_core_client(config)
        count = config.data_parallel_size
        clients: list[CoreClient | None] = [None] * count
        async with anyio.create_task_group() as tg:  # owns in-process engine cores' loops
            try:
                async def start(index: int) -> None:
                    # Each engine core knows its index: on CPU its workers take their share of the cores.
                    own = msgspec.structs.replace(config, data_parallel_rank=index)
                    clients[index] = await tg.start(start_one, own, setup, plugins, trace)

                async with anyio.create_task_group() as starting:
                    for index in range(count):
                        starting.start_soon(start, index)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    for started in clients:
                        if started is not None:
                            await started.close()
                raise
            client = cls(config, [c for c in clients if c is not None])
            task_status.started(client)
            async with client._merged_send:
                async with anyio.create_task_group() as readers:
                    for engine in client.engines:
                        readers.start_soon(client._read, engine, client._merged_send.clone())

    # -- CoreClient --------------------------------------------------------------------------------------

    async def send(self, message: Any) -> None:
        if isinstance(message, AddRequests):
            await self._add(message.requests)
        elif isinstance(message, AbortRequests):
            by_engine: dict[int, list[str]] = {}
            for request_id in message.request_ids:
                index = self._owner.get(request_id)
                if index is not None:
                    by_engine.setdefault(index, []).append(request_id)
            for index, ids in by_engine.items():
                await self._send_to(self.engines[index], AbortRequests(request_ids=ids))
        elif isinstance(message, UtilityCall):
            await self._call(message)
        else:  # Shutdown and the like: every live engine core
            for engine in self.engines:
                if engine.alive:
                    await self._send_to(engine, message)

    async def receive(self) -> Any:
        return await self._merged.receive()

    async def death_cause(self) -> str:
        return self._last_death[0]

    def death_exception(self) -> BaseException | None:
        return self._last_death[1]

    async def close(self) -> None:
        self._closing = True
        with anyio.CancelScope(shield=True):
            for engine in self.engines:
                await engine.client.close()
            self._merged.close()

    # -- requests ----------------------------------------------------------------------------------------

    async def _add(self, requests: list[EngineCoreRequest]) -> None:
        if not requests:
            return
        # Every completion of one request (they share prompt and parent) goes to one engine core.
        index = self.router.choose(requests[0].prompt_token_ids)
        engine = self.engines[index]
        for request in requests:
            self._owner[request.request_id] = index
            engine.held.add(request.request_id)
        self.router.loads[index] = len(engine.held)
        await self._send_to(engine, AddRequests(requests=requests))

    def _finished(self, engine: _Engine, request_id: str) -> None:
        self._owner.pop(request_id, None)
        engine.held.discard(request_id)
        self.router.loads[engine.index] = len(engine.held)

    async def _send_to(self, engine: _Engine, message: Any) -> None:
        if not engine.alive:
            return  # its requests have failed already (EngineLost); nothing there to abort
        try:
            await engine.client.send(message)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # it died: its reader sees the end of its stream and reports it

    # -- utility calls -----------------------------------------------------------------------------------

    async def _call(self, message: UtilityCall) -> None:
        live = [engine for engine in self.engines if engine.alive]
        call = _CombinedCall(message.call_id, message.method, {}, {engine.index for engine in live})
        own_id = self._next_call_id
        self._next_call_id += 1
        self._calls[own_id] = call
        for engine in live:
            await self._send_to(engine, UtilityCall(call_id=own_id, method=message.method, args=message.args))

    async def _on_result(self, engine: _Engine, message: UtilityResult, out: Any) -> None:
        call = self._calls.get(message.call_id)
        if call is None:
            return
        if message.error is not None and call.error is None:
            call.error = UtilityResult(call_id=call.call_id, error=f"engine core {engine.index}: {message.error}",
                                       error_type=message.error_type, error_field=message.error_field)
        call.results[engine.index] = message.result
        call.waiting.discard(engine.index)
        await self._answer_if_complete(message.call_id, call, out)

    async def _answer_if_complete(self, own_id: int, call: _CombinedCall, out: Any) -> None:
        if call.waiting:
            return
        del self._calls[own_id]
        if call.error is not None:
            await _forward(out, call.error)
            return
        if not call.results:
            await _forward(out, UtilityResult(call_id=call.call_id, error="every data-parallel engine core is dead",
                                         error_type="EngineDeadError"))
            return
        try:
            result = combine(call.method, [call.results[i] for i in sorted(call.results)], sorted(call.results))
        except (TypeError, ValueError, msgspec.ValidationError) as exc:  # results that do not combine: say so
            await _forward(out, UtilityResult(call_id=call.call_id, error_type="WorkerError",
                                         error=f"{call.method}: the engine cores' results do not combine: {exc}"))
            return
        await _forward(out, UtilityResult(call_id=call.call_id, result=result))

    # -- each engine core's messages ---------------------------------------------------------------------

    async def _read(self, engine: _Engine, out: Any) -> None:
        async with out:
            while True:
                try:
                    message = await engine.client.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    if not self._closing:
                        cause = await engine.client.death_cause()
                        dead = EngineCoreDead(process=f"data-parallel engine core {engine.index}", cause=cause)
                        await self._engine_died(engine, EngineDeadError(f"{dead.process}: {cause}"), dead, out)
                    return
                if isinstance(message, EngineCoreOutputs):
                    for output in message.outputs:
                        if output.finished:
                            self._finished(engine, output.request_id)
                    if message.scheduler_stats is not None:
                        message.scheduler_stats.engine_index = engine.index
                        self.router.kv_usage[engine.index] = message.scheduler_stats.kv_cache_usage
                    await _forward(out, message)
                elif isinstance(message, UtilityResult):
                    await self._on_result(engine, message, out)
                elif isinstance(message, EngineCoreDead):
                    error = EngineDeadError(f"data-parallel engine core {engine.index} ({message.process}): "
                                            f"{message.cause}",
                                            cause_type=message.cause_type, cause_message=message.cause_message,
                                            culprit=message.culprit)
                    await self._engine_died(engine, error, message, out)
                    return

    async def _engine_died(self, engine: _Engine, error: EngineDeadError, message: EngineCoreDead,
                           out: Any) -> None:
        engine.alive = False
        self.router.alive[engine.index] = False
        held = sorted(engine.held)
        for request_id in held:
            self._owner.pop(request_id, None)
        engine.held.clear()
        # Its share of every pending call: answered by the others alone.
        for own_id, call in list(self._calls.items()):
            if engine.index in call.waiting:
                call.waiting.discard(engine.index)
                await self._answer_if_complete(own_id, call, out)
        if any(other.alive for other in self.engines):
            logger.error("data-parallel engine core %d died (%s); %d of its requests fail, the other engine "
                         "cores serve on", engine.index, error, len(held))
            lost = EngineLost(engine.index, error, held)
            self.lost.append(lost)
            await _forward(out, lost)
            return
        # The last one: the engine is dead, as with a single engine core.
        self._last_death = (str(error), engine.client.death_exception())
        await _forward(out, message)


async def _forward(out: Any, message: Any) -> None:
    """Hand `message` to the AsyncEngine's output handler, unless the client is closed already."""
    try:
        await out.send(message)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass  # closed (the engine is shutting down): nobody reads any more


def combine(method: str, results: list[Any], indexes: list[int]) -> Any:
    """One answer from every live engine core's answer to `method` (in engine order)."""
    if method == "collective_rpc":
        return [item for result in results for item in result]
    if method == "get_scheduler_stats":
        per_engine = [msgspec.convert(result, SchedulerStats) for result in results]
        for stats, index in zip(per_engine, indexes):
            stats.engine_index = index
        total = SchedulerStats(
            num_running_reqs=sum(s.num_running_reqs for s in per_engine),
            num_waiting_reqs=sum(s.num_waiting_reqs for s in per_engine),
            kv_cache_usage=sum(s.kv_cache_usage for s in per_engine) / len(per_engine),
            num_preemptions=sum(s.num_preemptions for s in per_engine),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in per_engine),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in per_engine),
            num_prompt_tokens_computed=sum(s.num_prompt_tokens_computed for s in per_engine),
            num_kv_connector_loaded_tokens=sum(s.num_kv_connector_loaded_tokens for s in per_engine),
            structured_outputs_cache_bytes=sum(s.structured_outputs_cache_bytes for s in per_engine),
            structured_outputs_cache_entries=sum(s.structured_outputs_cache_entries for s in per_engine),
            encoder_cache_entries=sum(s.encoder_cache_entries for s in per_engine),
            encoder_cache_rows=sum(s.encoder_cache_rows for s in per_engine),
            expert_tokens=_sum_per_index([s.expert_tokens for s in per_engine]),
            spec_decode_num_drafts=sum(s.spec_decode_num_drafts for s in per_engine),
            spec_decode_num_draft_tokens=sum(s.spec_decode_num_draft_tokens for s in per_engine),
            spec_decode_num_accepted_tokens=sum(s.spec_decode_num_accepted_tokens for s in per_engine),
            spec_decode_num_accepted_tokens_per_pos=_sum_per_index(
                [s.spec_decode_num_accepted_tokens_per_pos for s in per_engine]),
            engines=per_engine,
        )
        return msgspec.to_builtins(total)
    return results[0]


def _sum_per_index(counts: list[list[int] | None]) -> list[int] | None:
    """The engine cores' totals per index (tokens per expert, accepted drafts per position), summed index by
    index (None when none has reported any)."""
    known = [c for c in counts if c is not None]
    return [sum(column) for column in zip(*known)] if known else None


def start_client(config: EngineConfig) -> Callable[..., Coroutine[Any, Any, None]]:
    """`start_core_client`, with data parallelism: the task that starts the frontend's CoreClient."""
    return DataParallelCoreClient.serve if config.data_parallel_size > 1 else start_core_client(config)


__all__ = ["DataParallelCoreClient", "EngineLost", "Router", "combine", "start_client"]
