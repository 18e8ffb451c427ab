"""Worker processes: one per tensor-parallel rank, spawned, connected back and taken through start-up.

The multiprocess executor serves with them (executor.py, after StartupParams); `asyncengine plugins
check` starts them with CheckParams, so that each rank runs its own plugin phases and stops (check.py).
Either way every rank's start-up records land in the engine core's trace, and a rank that fails is
reported with its error, named.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import Process

from asyncengine.errors import StartupError, rebuild_error
from asyncengine.plugin_runtime.records import StartupTrace, reported_by_child
from asyncengine.runtime.connection import Listener, accept_child, open_listener
from asyncengine.runtime.groups import single_exceptions
from asyncengine.runtime.spawn import describe_exit, spawn_child, stop_process
from asyncengine.wire.framing import FrameStream, ProtocolError
from asyncengine.wire.messages import CheckParams, ExecutorInbox, Hello, Ready, StartupFailed, StartupParams

WORKER_START_TIMEOUT = 600.0  # loading a large model can take minutes


class WorkerProcesses:
    """Local processes; the Ray executor's RayWorkers (ray_executor.py) places them with Ray instead, by
    overriding how the ranks are started (`_open_listener`, `_spawn`) and named."""

    def __init__(self) -> None:
        self.processes: list[Process] = []
        self.connections: list[FrameStream] = []  # by rank, once every rank has connected
        # torch.distributed's rendezvous for several ranks (rank 0 listens there), known once they are started.
        self.rendezvous: str | None = None
        # What each rank's Ready said about itself (its `info`), once every rank is up.
        self.ready_info: dict[int, dict[str, Any]] = {}

    def rank_name(self, rank: int) -> str:
        return f"worker rank {rank} (pid {self.processes[rank].pid})"

    def describe_exit(self, rank: int) -> str:
        """How rank `rank`'s process ended, in the words of an EngineDeadError."""
        return describe_exit(self.processes[rank].returncode)

    async def _open_listener(self) -> Listener:
        return await open_listener()

    async def _spawn(self, world_size: int, listener: Listener) -> None:
        """Start every rank, each connecting back to `listener`; fill `processes` (and `rendezvous`)."""
        if world_size > 1:
            self.rendezvous = f"tcp://127.0.0.1:{_free_port()}"
        for rank in range(world_size):
            self.processes.append(
                await spawn_child("asyncengine.worker.process", address=listener.address,
                                  secret=listener.secret, rank=rank)
            )

    def _startup_failure(self, rank: int, error: BaseException) -> BaseException:
        """The error a rank's StartupFailed becomes (here: its own; Ray adds the node)."""
        return error

    async def start(self, world_size: int, hand_shake: Callable[[int], StartupParams | CheckParams],
                    trace: StartupTrace) -> None:
        """Spawn `world_size` ranks, send each `hand_shake(rank)` and wait until every rank has answered;
        the first that failed raises its error. The processes stay in `processes` either way: `stop`
        stops them."""
        listener = await self._open_listener()
        try:
            await self._spawn(world_size, listener)
            by_rank: dict[int, FrameStream] = {}
            for _ in range(world_size):
                frames, hello = await self._accept(listener)
                by_rank[hello.rank] = frames
            self.connections = [by_rank[rank] for rank in range(world_size)]
        finally:
            await listener.aclose()
        for rank, frames in enumerate(self.connections):
            await frames.send(hand_shake(rank))
        # Every rank starts at once (and, serving, joins the process group): wait for all, each in its own
        # task. The first failure ends the wait: the other ranks may be waiting for the failed one to join
        # the process group, which it never will (a plugin missing on one node only, say).
        replies: dict[int, Ready | StartupFailed] = {}
        failures: list[BaseException] = []

        async def receive(rank: int, frames: FrameStream, scope: anyio.CancelScope) -> None:
            reply = replies[rank] = await self._receive_startup(rank, frames)
            if isinstance(reply, StartupFailed) and not failures:
                failures.append(self._startup_failure(rank, reported_by_child(
                    rebuild_error(reply.error_type, reply.error, reply.error_field, default=StartupError))))
                scope.cancel()

        with single_exceptions():
            async with anyio.create_task_group() as tg:
                for rank, frames in enumerate(self.connections):
                    tg.start_soon(receive, rank, frames, tg.cancel_scope)
        for rank in sorted(replies):
            trace.extend(replies[rank].records)
        self.ready_info = {rank: reply.info for rank, reply in replies.items() if isinstance(reply, Ready)}
        if failures:
            raise failures[0]

    async def stop(self, *, grace_period: float) -> None:
        """Wait up to `grace_period` for each process to exit, then force it; close the connections."""
        with anyio.CancelScope(shield=True):
            for process in self.processes:
                await stop_process(process, grace_period=grace_period)
            for frames in self.connections:
                await frames.aclose()

    async def _accept(self, listener: Listener) -> tuple[FrameStream, Hello]:
        try:
            return await accept_child(listener, ExecutorInbox, role="worker", timeout=WORKER_START_TIMEOUT)
        except TimeoutError as exc:
            exits = [f"rank {r} {self.describe_exit(r)}" for r in range(len(self.processes))]
            raise StartupError(f"worker processes did not connect ({'; '.join(exits)})") from exc

    async def _receive_startup(self, rank: int, frames: FrameStream) -> Ready | StartupFailed:
        try:
            with anyio.fail_after(WORKER_START_TIMEOUT):
                reply = await frames.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, ProtocolError, TimeoutError) as exc:
            process = self.processes[rank]
            with anyio.move_on_after(2.0):
                await process.wait()
            raise StartupError(f"{self.rank_name(rank)} {self.describe_exit(rank)} during start-up") from exc
        if not isinstance(reply, (Ready, StartupFailed)):
            raise StartupError(f"{self.rank_name(rank)} sent {type(reply).__name__} instead of Ready")
        return reply


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
