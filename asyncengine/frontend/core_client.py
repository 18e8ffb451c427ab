"""How the frontend talks to its engine core: the same messages, two placements.

`InProcessCoreClient` runs the engine core's loop as tasks of the caller's event loop, connected by
memory object streams. `ProcessCoreClient` starts the engine core as a fresh interpreter and talks to
it in frames over a Unix socket in a private directory (or TCP with a secret). Either starts as a step
of its owner's start-up, `client = await tg.start(start_core_client(config), config, setup, plugins, trace)`.

Every client also carries the calls into the engine core (`call`: a named engine-core method;
`collective_rpc`: a worker method on every rank): each call is a UtilityCall with an id, answered by a
UtilityResult that `get_output` hands to its waiting caller, so the frontend's output handler sees only
the steps' outputs and the engine's deaths.

`check_engine_core` is `asyncengine plugins check`'s path instead: the engine core's start-up phases and
its workers', in this process or in its own, and no model, so the serving path always has one.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

import anyio
import msgspec
from anyio.abc import Process, TaskStatus

from asyncengine.config.engine import EngineConfig
from asyncengine.engine_core.check import check_workers
from asyncengine.engine_core.core import EngineCore, run_engine_core
from asyncengine.engine_core.loop import EngineCoreLoop
from asyncengine.errors import EngineDeadError, StartupError, rebuild_error
from asyncengine.frontend.startup import FrontendSetup
from asyncengine.plugin_runtime.platform_resolution import current_platform_key
from asyncengine.plugin_runtime.records import StartupTrace, reported_by_child
from asyncengine.runtime.connection import accept_child, open_listener
from asyncengine.runtime.groups import single_exceptions
from asyncengine.runtime.reply import Reply
from asyncengine.runtime.spawn import describe_exit, spawn_child, stop_process
from asyncengine.wire.framing import FrameStream
from asyncengine.wire.messages import (
    CheckParams,
    FrontendInbox,
    Ready,
    Shutdown,
    StartupFailed,
    StartupParams,
    UtilityCall,
    UtilityResult,
)

ENGINE_CORE_START_TIMEOUT = 900.0  # it loads the model before it says Ready
T = TypeVar("T")


class CoreClient(ABC):
    process_name: str

    def __init__(self) -> None:
        self._pending_calls: dict[int, Reply] = {}  # calls into the engine core, waiting for their result
        self._call_ids = itertools.count()
        self._calls_failed: EngineDeadError | None = None  # once set, every call fails with it

    @abstractmethod
    async def send(self, message: Any) -> None: ...

    @abstractmethod
    async def receive(self) -> Any:
        """The next message from the engine core; anyio.EndOfStream once it is gone."""

    @abstractmethod
    async def death_cause(self) -> str:
        """Why the engine core went away, once `receive` has ended without a Shutdown."""

    @abstractmethod
    async def close(self) -> None:
        """Ask the engine core to stop and wait for it (forcing it after a grace period)."""

    def death_exception(self) -> BaseException | None:
        """The exception that killed the engine core, when it ran in this process (else None: only
        its type, message and culprit crossed, on EngineCoreDead)."""
        return None

    # -- calls into the engine core and the workers -----------------------------------------------------

    async def get_output(self) -> Any:
        """The next message from the engine core other than a call's result (each is handed to its
        caller here): a step's EngineCoreOutputs, EngineCoreDead, or (data parallelism) EngineLost."""
        while True:
            message = await self.receive()
            if not isinstance(message, UtilityResult):
                return message
            reply = self._pending_calls.get(message.call_id)
            if reply is not None:
                if message.error is not None:
                    reply.fail(rebuild_error(message.error_type, message.error, message.error_field))
                else:
                    reply.set(message.result)

    async def call(self, method: str, *args: Any) -> Any:
        """A named engine-core call (`get_scheduler_stats`, `kv_cache_info`, ...): its result, or its error
        raised here (typed as in the engine core)."""
        if self._calls_failed is not None:
            raise self._calls_failed.again()
        call_id = next(self._call_ids)
        reply = self._pending_calls[call_id] = Reply()
        try:
            await self.send(UtilityCall(call_id=call_id, method=method, args=list(args)))
            return await reply.wait()
        finally:
            self._pending_calls.pop(call_id, None)

    def fail_calls(self, error: EngineDeadError) -> None:
        """The engine died or shut down: the calls waiting fail with `error`, and so does every later one."""
        self._calls_failed = error
        for reply in self._pending_calls.values():
            reply.fail(error)

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] | list[Any] = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run public worker method `method(*args, **kwargs)` on every rank; each rank's result
        (msgspec-encodable). vLLM's signature: `timeout` in seconds (then TimeoutError). The arguments must
        be msgspec-encodable (a TypeError names one that is not), and every worker gets them as a worker
        process decodes them (a tuple as a list, a Struct as a dict), in-process too. `collective_rpc(method,
        args)` (args second) still works."""
        if isinstance(timeout, (list, tuple)):  # the older form, args second: a list or tuple is no timeout
            if isinstance(args, Mapping) and kwargs is None:  # (method, args, kwargs)
                args, kwargs = (), args
            if args != ():
                raise TypeError(f"collective_rpc({method!r}, {timeout!r}, {args!r}): with the arguments second, "
                                "the third is the keyword arguments (a dict); or pass timeout, args, kwargs by name")
            timeout, args = None, timeout
        worker_args, worker_kwargs = rpc_arguments(method, args, kwargs)
        with anyio.fail_after(timeout):  # None: no deadline
            result: list[Any] = await self.call("collective_rpc", method, worker_args, worker_kwargs)
            return result


_RPC_ENCODER, _RPC_DECODER = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()


def rpc_arguments(method: str, args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any] | None]:
    """collective_rpc's `args` and `kwargs` as every worker receives them (what msgpack decodes), each
    checked to encode: a TypeError names the argument that cannot travel to a worker process."""
    call = f"collective_rpc({method!r})"
    if not isinstance(args, (list, tuple)):
        raise TypeError(f"{call}: args is a {type(args).__name__}; pass the positional arguments as a list or tuple")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"{call}: kwargs is a {type(kwargs).__name__}; pass the keyword arguments as a dict")
    for name in kwargs or ():
        if not isinstance(name, str):
            raise TypeError(f"{call}: keyword argument name {name!r} ({type(name).__name__}) is not a string")

    def decoded(what: str, value: Any) -> Any:
        try:
            return _RPC_DECODER.decode(_RPC_ENCODER.encode(value))
        except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError) as exc:
            raise TypeError(f"{call}: {what} ({type(value).__name__}) cannot be sent to the workers: {exc}; pass "
                            "msgspec-encodable values (None, bool, int, float, str, bytes, lists, dicts, "
                            "msgspec Structs)") from None

    worker_args = [decoded(f"positional argument {index}", value) for index, value in enumerate(args)]
    worker_kwargs = {name: decoded(f"keyword argument {name!r}", value) for name, value in (kwargs or {}).items()}
    return worker_args, worker_kwargs or None


class InProcessCoreClient(CoreClient):
    process_name = "the engine core (in-process)"

    def __init__(self, core: EngineCore) -> None:
        super().__init__()
        # Both bounded, and neither reader waits on its writer: the loop's inbox handler never sends
        # (grammar compilation and calls answer from tasks of their own), so a full outbox cannot stop
        # it taking requests and aborts. 1024 messages in: a burst of submissions from many tasks
        # before the loop's next turn; 64 out: one message per step, so the loop runs at most 64
        # steps ahead of a busy output handler before `send` waits (backpressure, not loss).
        self._to_core, self._core_inbox = anyio.create_memory_object_stream[Any](1024)
        self._core_outbox, self._from_core = anyio.create_memory_object_stream[Any](64)
        self.loop = EngineCoreLoop(core, self._core_outbox.send, process_name=self.process_name)
        self._stopped = anyio.Event()

    @classmethod
    async def serve(cls, config: EngineConfig, setup: FrontendSetup, plugins: Any, trace: StartupTrace, *,
                    task_status: TaskStatus[InProcessCoreClient] = anyio.TASK_STATUS_IGNORED) -> None:
        """The engine core in this event loop: its start-up phases (recorded in `trace`), then
        `task_status.started(client)`, then its step loop until `close()`."""
        core_trace = StartupTrace("engine core")  # the same process, in its engine-core role
        with single_exceptions():  # a failed phase, not a group around it
            async with anyio.create_task_group() as tg:  # owns the engine core's executor
                try:
                    # The frontend's manifest: each worker process (mp, Ray) compares its registries with it.
                    core = await tg.start(run_engine_core, config, setup.model_config, plugins, core_trace,
                                          plugins.manifest)
                    async with core_trace.phase("ready"):
                        pass
                finally:
                    trace.extend(core_trace.records)
                client = cls(core)
                task_status.started(client)
                await client._serve()  # the loop shuts the executor down as it ends

    async def _serve(self) -> None:
        try:
            await self.loop.serve(self._core_inbox)
        finally:
            self._core_inbox.close()
            self._core_outbox.close()  # a consumer waiting in receive() gets EndOfStream
            self._stopped.set()

    async def send(self, message: Any) -> None:
        await self._to_core.send(message)

    async def receive(self) -> Any:
        return await self._from_core.receive()

    async def death_cause(self) -> str:
        return f"{self.process_name} stopped"

    def death_exception(self) -> BaseException | None:
        death = self.loop.death
        return death.__cause__ if death is not None and death.__cause__ is not None else death

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            self._to_core.close()  # the loop sees the end of its inbox and stops
            with anyio.move_on_after(30.0):
                await self._stopped.wait()
            self._from_core.close()  # every stream end closed by its owner: none is left to the collector


class ProcessCoreClient(CoreClient):
    def __init__(self, process: Process, frames: FrameStream) -> None:
        super().__init__()
        self.process = process
        self.frames = frames
        self.process_name = f"the engine core (pid {process.pid})"

    @classmethod
    async def serve(cls, config: EngineConfig, setup: FrontendSetup, plugins: Any, trace: StartupTrace, *,
                    task_status: TaskStatus[ProcessCoreClient] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the engine-core process (its records go to `trace`), then `task_status.started(client)`.
        The client needs no task of its own: `close()` stops the process."""
        params = StartupParams(engine_config=config, model_config=setup.model_config,
                               platform=current_platform_key(), manifest=plugins.manifest)
        task_status.started(await cls._start(config, params, trace))

    @classmethod
    async def _start(cls, config: EngineConfig, params: StartupParams | CheckParams,
                     trace: StartupTrace) -> ProcessCoreClient:
        """Spawn the engine core, send it `params` and wait for its Ready (StartupFailed raises, named)."""
        listener = await open_listener(config.transport)
        process = None
        try:
            process = await spawn_child("asyncengine.engine_core.process", address=listener.address,
                                        secret=listener.secret)
            frames, _ = await _while_alive(
                process, "connecting",
                lambda: accept_child(listener, FrontendInbox, role="engine core", timeout=ENGINE_CORE_START_TIMEOUT),
            )
        except BaseException:
            if process is not None:
                await stop_process(process, grace_period=0.0)
            raise
        finally:
            await listener.aclose()
        client = cls(process, frames)
        try:
            await frames.send(params)
            reply = await _while_alive(process, "starting", frames.receive)
            if not isinstance(reply, (Ready, StartupFailed)):
                raise StartupError(f"{client.process_name} sent {type(reply).__name__} instead of Ready")
            trace.extend(reply.records)
            if isinstance(reply, StartupFailed):
                raise reported_by_child(
                    rebuild_error(reply.error_type, reply.error, reply.error_field, default=StartupError))
        except BaseException:
            await client.close()
            raise
        return client

    async def send(self, message: Any) -> None:
        await self.frames.send(message)

    async def receive(self) -> Any:
        try:
            return await self.frames.receive()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise anyio.EndOfStream from exc

    async def death_cause(self) -> str:
        with anyio.move_on_after(2.0):  # the socket closes a moment before the exit is visible
            await self.process.wait()
        return f"{self.process_name} {describe_exit(self.process.returncode)}"

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                with anyio.move_on_after(2.0):
                    try:
                        await self.frames.send(Shutdown())
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        pass  # already gone; stop_process reaps it
            await stop_process(self.process, grace_period=10.0)
            await self.frames.aclose()


async def _while_alive(process: Process, doing: str, work: Callable[[], Awaitable[T]]) -> T:
    """`await work()`, unless `process` exits first: then a StartupError saying how it ended."""
    result: list[T] = []
    failure: list[BaseException] = []

    async def run_work(scope: anyio.CancelScope) -> None:
        try:
            result.append(await work())
        except Exception as exc:  # re-raised below, outside the task group (which would wrap it in a group)
            failure.append(exc)
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_work, tg.cancel_scope)
        await process.wait()
        tg.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if result:
        return result[0]
    raise StartupError(
        f"the engine core (pid {process.pid}) {describe_exit(process.returncode)} while {doing}; "
        "its log above says why"
    )


def start_core_client(config: EngineConfig) -> Callable[..., Coroutine[Any, Any, None]]:
    """The task that starts the configured placement's client, for `await tg.start(it, config, setup,
    plugin_state, trace)`, which returns the started CoreClient."""
    return InProcessCoreClient.serve if config.in_process else ProcessCoreClient.serve


async def check_engine_core(config: EngineConfig, plugins: Any, trace: StartupTrace) -> None:
    """`asyncengine plugins check`: the engine core's start-up phases and its workers' (their records in
    `trace`), in this process or in its own as `config.in_process` says, loading no model. A phase that
    fails raises its error, naming the process and the phase."""
    if not config.in_process:
        params = CheckParams(engine_config=config, platform=current_platform_key(), manifest=plugins.manifest)
        client = await ProcessCoreClient._start(config, params, trace)
        await client.close()
        return
    core_trace = StartupTrace("engine core")  # the same process, in its engine-core role
    try:
        await check_workers(config, core_trace, plugins.manifest)
        async with core_trace.phase("ready"):
            pass
    finally:
        trace.extend(core_trace.records)
