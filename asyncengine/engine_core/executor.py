"""Executors run the workers for the engine core: in a thread of this process (`uni`) or one process
per tensor-parallel rank (`mp`).

`serve` is the task that owns the workers: the engine core starts it with `await tg.start(...)`, it
calls `task_status.started()` once every worker is up, and it returns after `shutdown()` (or stops
the workers itself if it is cancelled first). Both take work in order: steps (`submit_step`, answered
later through a `Reply`, so the engine core can schedule step N+1 while step N runs) and calls by
method name (`call`, on every rank). When a worker dies or raises, the executor records an
`EngineDeadError` naming it and fails every reply.
"""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from anyio.abc import TaskStatus

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.errors import (
    AsyncEngineError,
    EngineDeadError,
    RequestError,
    WorkerError,
    error_field,
    rebuild_error,
)
from asyncengine.interfaces.executor import Executor
from asyncengine.plugin_runtime.platform_resolution import current_platform_key
from asyncengine.engine_core.worker_processes import WorkerProcesses
from asyncengine.plugin_runtime.records import StartupTrace
from asyncengine.interfaces.registry import reads
from asyncengine.runtime.dedicated_thread import DedicatedThread
from asyncengine.runtime.groups import single_exceptions
from asyncengine.runtime.reply import Reply
from asyncengine.structured_output.deferred import DeferredMask, takes_grammar
from asyncengine.wire.framing import FrameStream, ProtocolError
from asyncengine.wire.messages import (
    ExecuteModel,
    GrammarMasks,
    Shutdown,
    StartupParams,
    StepResult,
    WorkerCall,
    WorkerCallResult,
)
from asyncengine.wire.worker import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from asyncengine.worker.extension import rpc_method

if TYPE_CHECKING:
    from asyncengine.interfaces.platform import Platform

_ROUND_TRIP = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
RAY_EXECUTOR = "asyncengine.engine_core.ray_executor:RayExecutor"


# The interface (the Executor ABC) is in the floor, asyncengine.interfaces.executor; imported above.


class UniExecutor(Executor):
    """One worker on a dedicated thread of this process: model execution stays off the event loop."""

    worker_placement = "uni"  # this process plays the worker role too (its plugin phases)

    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, platform: type[Platform], *, owner: str,
                 logits_processors: tuple[type, ...] | list[type] = ()) -> None:
        super().__init__(engine_config, model_config, platform)
        # This process ran the worker role's plugin phases: its logits-processor classes are the worker's.
        self._logits_processors = tuple(logits_processors)
        self.worker: Any = None  # built by serve(), on the worker's thread
        self.where = f"the worker (a thread of {owner})"
        self._thread = DedicatedThread("asyncengine-worker")
        self._stopped = False

    def _build_worker(self) -> Any:
        # On the worker's thread: importing the model runner and the models (torch's modules among them)
        # takes half a second on a busy machine, too long for the event loop.
        from asyncengine.worker.build import build_worker

        # The class is the one `worker_cls` names, the built-in Worker by default.
        return build_worker(self.engine_config, self.model_config, self.platform,
                            logits_processors=self._logits_processors)

    async def serve(self, trace: StartupTrace, manifest: Any = None, *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        # The worker's plugin phases ran in this process already (it plays the worker role too).
        try:
            with single_exceptions():  # a failed init_device, not a group around it
                async with anyio.create_task_group() as tg:
                    await tg.start(self._thread.serve)  # returns once shutdown() closed the thread
                    self.worker = await self._thread.run(self._build_worker)
                    # A step's masks can follow it to this worker (structured_output/deferred.py) unless a
                    # subclass's submit_step or a worker_cls's execute_model predates the `grammar` argument.
                    self.supports_deferred_grammar = (takes_grammar(self.submit_step)
                                                      and takes_grammar(self.worker.execute_model))
                    await self.call("init_device")
                    task_status.started()
        except BaseException:  # failed or cancelled: the worker stops with it (a subclass's shutdown runs once)
            if not self._stopped:
                await self.shutdown()
            raise

    async def submit_step(self, scheduler_output: SchedulerOutput, grammar: Any = None) -> Reply:
        if self.failure is not None:
            reply = Reply()
            reply.fail(self.failure)
            return reply
        if grammar is None:
            return _StepReply(self, self._thread.submit(self.worker.execute_model, scheduler_output))
        return _StepReply(self, self._thread.submit(self.worker.execute_model, scheduler_output, grammar))

    async def call(self, method: str, /, *args: Any, **kwargs: Any) -> list[Any]:
        if self.failure is not None:
            raise self.failure
        _check_method_name(method)
        try:  # the worker's method, else its extension's: the same lookup as in a worker process
            function = rpc_method(self.worker, method)
        except WorkerError as exc:
            raise WorkerError(f"{self.where}: {exc}") from None
        try:
            return [await self._thread.run(partial(function, **kwargs) if kwargs else function, *args)]
        except Exception as exc:  # re-raised with the worker named, keeping our error types
            raise _name_the_worker(self.where, exc) from exc

    async def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        with anyio.CancelScope(shield=True):
            if self.failure is None and self.worker is not None:
                with anyio.move_on_after(5.0):
                    await self._thread.run(self.worker.shutdown)
            self._die(EngineDeadError("the engine was shut down"))
            self._thread.close()


class _StepReply(Reply):
    """A step's reply from the dedicated thread: a failed step kills the engine, naming the worker."""

    def __init__(self, executor: UniExecutor, inner: Reply) -> None:
        super().__init__()
        self._executor = executor
        self._inner = inner

    async def wait(self) -> ModelRunnerOutput:
        try:
            return await self._inner.wait()
        except Exception as exc:  # a step failed: the engine is dead, and says why
            error = EngineDeadError.from_exception(self._executor.where, exc, process=self._executor.where,
                                                   phase="execute_model")
            self._executor._die(error)
            raise (self._executor.failure or error) from exc  # the first failure recorded


class MultiprocExecutor(Executor):
    """One worker process per tensor-parallel rank, connected over framed sockets."""

    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, platform: type[Platform]) -> None:
        super().__init__(engine_config, model_config, platform)
        self._workers = self._new_workers()
        # Per rank, the replies still owed, in the order the work was sent.
        self._pending_steps: list[deque[Reply]] = [deque() for _ in range(self.world_size)]
        self._pending_calls: dict[int, list[Reply]] = {}
        self._next_call_id = 0
        self._stopping = False

    async def serve(self, trace: StartupTrace, manifest: Any = None, *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        def startup_params(rank: int) -> StartupParams:  # once every rank is started (and the rendezvous known)
            return StartupParams(
                engine_config=self.engine_config, model_config=self.model_config, platform=current_platform_key(),
                manifest=manifest, rank=rank, world_size=self.world_size,
                distributed_init_method=self._workers.rendezvous if self.world_size > 1 else None,
            )

        try:
            await self._workers.start(self.world_size, startup_params, trace)
            # Masks may follow their step when every rank's worker waits for them (its Ready says so) and
            # a subclass's submit_step still takes the argument.
            ready_info = self._workers.ready_info
            self.supports_deferred_grammar = (
                takes_grammar(self.submit_step) and len(ready_info) == self.world_size
                and all(info.get("deferred_grammar") is True for info in ready_info.values()))
            # Each rank's connection and process, watched until shutdown() (or a death, which fails every reply).
            with single_exceptions():
                async with anyio.create_task_group() as tg:
                    for rank in range(self.world_size):
                        tg.start_soon(self._receive_loop, rank)
                        tg.start_soon(self._watch_process, rank)
                    task_status.started()
        except BaseException:  # failed or cancelled: the workers stop with it (a subclass's shutdown runs once)
            if not self._stopping:
                await self.shutdown()
            raise

    def _new_workers(self) -> WorkerProcesses:
        return WorkerProcesses()

    def _rank_name(self, rank: int) -> str:
        return self._workers.rank_name(rank)

    async def _receive_loop(self, rank: int) -> None:
        frames = self._workers.connections[rank]
        try:
            while True:
                message = await frames.receive()
                if isinstance(message, StepResult):
                    if not self._pending_steps[rank]:
                        continue  # its reply was failed already: another rank died first (_fail_all)
                    reply = self._pending_steps[rank].popleft()
                    if message.error is not None:
                        reply.fail(self._fail_all(EngineDeadError(
                            f"{self._rank_name(rank)} failed: {message.error}", cause_type=message.error_type,
                            cause_message=message.error_message, culprit=message.culprit)))
                    else:
                        reply.set(message.output)
                elif isinstance(message, WorkerCallResult):
                    replies = self._pending_calls.get(message.call_id)
                    if replies is None:
                        continue
                    if message.error is not None:
                        replies[rank].fail(rebuild_error(
                            message.error_type, f"{self._rank_name(rank)}: {message.error}", message.error_field
                        ))
                    else:
                        replies[rank].set(message.result)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, ProtocolError):
            await self._lost(rank)

    async def _watch_process(self, rank: int) -> None:
        await self._workers.processes[rank].wait()
        await self._lost(rank)

    async def _lost(self, rank: int) -> EngineDeadError:
        """Rank `rank`'s connection or process is gone: the engine is dead (unless it is being shut down);
        what it died of."""
        if self._stopping:
            return self.failure or EngineDeadError("the engine was shut down")
        process = self._workers.processes[rank]
        with anyio.move_on_after(2.0):  # the connection usually closes a moment before the exit is seen
            await process.wait()
        return self._fail_all(EngineDeadError(f"{self._rank_name(rank)} {self._workers.describe_exit(rank)}"))

    def _fail_all(self, error: EngineDeadError) -> EngineDeadError:
        """Record `error` (unless a failure came first) and fail every reply owed with the recorded one."""
        self._die(error)
        failure = self.failure or error
        for pending in self._pending_steps:
            while pending:
                pending.popleft().fail(failure)
        for replies in self._pending_calls.values():
            for reply in replies:
                reply.fail(failure)
        return failure

    async def submit_step(self, scheduler_output: SchedulerOutput, grammar: Any = None) -> Reply:
        # (`grammar`: a step whose masks follow it; they go to every rank in deliver_masks)
        replies = [Reply() for _ in range(self.world_size)]
        if self.failure is not None:
            replies[0].fail(self.failure)
            return replies[0]
        message = ExecuteModel(scheduler_output=scheduler_output)
        for rank, frames in enumerate(self._workers.connections):
            self._pending_steps[rank].append(replies[rank])
            await self._send(rank, frames, message)
        if self.world_size == 1:
            return replies[0]
        # With pipeline stages the last one samples: its first rank's output has the logprobs.
        return _AllRanks(replies, self.world_size - self.engine_config.tensor_parallel_size)

    async def call(self, method: str, /, *args: Any, **kwargs: Any) -> list[Any]:
        if self.failure is not None:
            raise self.failure
        _check_method_name(method)
        call_id = self._next_call_id
        self._next_call_id += 1
        replies = [Reply() for _ in range(self.world_size)]
        self._pending_calls[call_id] = replies
        try:
            for rank, frames in enumerate(self._workers.connections):
                await self._send(rank, frames, WorkerCall(call_id=call_id, method=method, args=list(args),
                                                          kwargs=kwargs or None))
            return [await reply.wait() for reply in replies]
        finally:
            del self._pending_calls[call_id]

    async def deliver_masks(self, mask: DeferredMask, bitmask: GrammarBitmask | None) -> None:
        """Every rank's process sets them on the DeferredMask of the step that waits (worker/process.py)."""
        mask.set(bitmask)
        if self.failure is not None:
            return
        message = GrammarMasks(bitmask=bitmask)
        for rank, frames in enumerate(self._workers.connections):
            await self._send(rank, frames, message)

    async def _send(self, rank: int, frames: FrameStream, message: Any) -> None:
        try:
            await frames.send(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise await self._lost(rank) from None

    async def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._die(EngineDeadError("the engine was shut down"))
        with anyio.CancelScope(shield=True):
            for frames in self._workers.connections:
                with anyio.move_on_after(1.0):
                    try:
                        await frames.send(Shutdown())
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        pass  # already gone: stop() below reaps it
            await self._workers.stop(grace_period=5.0)


class _AllRanks(Reply):
    """Rank `output_rank`'s output (0, or the last pipeline stage's first) once every rank has finished
    the step (a failure on any rank fails it)."""

    def __init__(self, replies: list[Reply], output_rank: int = 0) -> None:
        super().__init__()
        self._replies = replies
        self._output_rank = output_rank

    async def wait(self) -> ModelRunnerOutput:
        results = [await reply.wait() for reply in self._replies]
        return results[self._output_rank]


def _name_the_worker(where: str, exc: Exception) -> Exception:
    """The same error as a peer process would report it: our types keep their type, others become WorkerError."""
    message = str(exc) if isinstance(exc, AsyncEngineError) else f"{type(exc).__name__}: {exc}"
    return rebuild_error(type(exc).__name__, f"{where}: {message}", error_field(exc))


def _check_method_name(method: str) -> None:
    if not isinstance(method, str) or not method or method.startswith("_"):
        raise RequestError(f"worker method {method!r} cannot be called: only public methods are callable",
                           field="method")


def round_trip(value: Any) -> Any:
    """What `value` becomes after crossing a process boundary: collective_rpc gives every executor's
    callers the same types (lists, dicts, numbers, strings), wherever the worker runs."""
    encoder, decoder = _ROUND_TRIP
    return decoder.decode(encoder.encode(value))


@reads("hook:distributed_executor_backend", "engine core")
def build_executor(engine_config: EngineConfig, model_config: ModelConfig, plugin_state: Any, *,
                   owner: str) -> Executor:
    backend = engine_config.executor_backend
    cls: type[Executor]
    if backend == "uni":
        cls = UniExecutor
    elif backend == "mp":
        cls = MultiprocExecutor
    elif backend == "ray":  # by path: ray_executor.py subclasses MultiprocExecutor, and Ray is an optional extra
        from asyncengine.interfaces.imports import import_by_path

        cls = import_by_path(RAY_EXECUTOR, what="the Ray executor")
    else:  # "pkg.mod:Class", checked to be an Executor subclass
        from asyncengine.plugin_runtime.config_hooks import load_hook

        cls = load_hook("distributed_executor_backend", backend)
    if issubclass(cls, UniExecutor):
        return cls(engine_config, model_config, plugin_state.platform, owner=owner,
                   logits_processors=plugin_state.logits_processors)
    return cls(engine_config, model_config, plugin_state.platform)
