"""DedicatedThread: run blocking calls one at a time on one long-lived OS thread.

Model execution must stay off the event loop, but not on whichever pooled thread is free: torch's
intra-op (OpenMP) thread team belongs to the thread that calls it, and a second calling thread gets
a team of its own while the first team still spins, which halves a 2-core machine. So each worker
keeps one thread for its whole life. Calls queue without blocking (`submit`), which is what lets the
engine core hand over step N+1 while step N runs; and the thread hands each result back without
waiting for the event loop to take it (the event loop's own thread-safe "call soon"), so it starts
the next call at once.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskStatus

from asyncengine.runtime.reply import Reply


class DedicatedThread:
    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Reply] | None] = queue.SimpleQueue()
        self._closed = False

    async def serve(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """The task that owns the thread; returns once `close()` was called and the queue drained."""
        call_soon = _event_loop_call_soon()
        task_status.started()
        await anyio.to_thread.run_sync(self._main, call_soon, abandon_on_cancel=True)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Reply:
        reply = Reply()
        if self._closed:
            reply.fail(RuntimeError(f"{self.name} is closed"))
        else:
            self._queue.put((fn, args, reply))
        return reply

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.submit(fn, *args).wait()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)

    def _main(self, call_soon: Callable[..., Any]) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, reply = item
            outcome: tuple[Callable[..., None], Any]  # (reply.set, the value) or (reply.fail, the error)
            try:
                outcome = (reply.set, fn(*args))
            except Exception as exc:  # handed to the awaiting task, which decides what it means
                outcome = (reply.fail, exc)
            try:
                call_soon(*outcome)
            except RuntimeError:
                return  # the event loop has finished (trio's RunFinishedError is a RuntimeError): nobody waits


def _event_loop_call_soon() -> Callable[..., Any]:
    """The running event loop's non-blocking, thread-safe way to schedule a call on it."""
    import sniffio

    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    import asyncio

    return asyncio.get_running_loop().call_soon_threadsafe
