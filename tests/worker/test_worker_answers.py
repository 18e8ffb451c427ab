"""The worker process's queue of answers owed is bounded (worker/process.py, ANSWERS_BOUND): while the
engine core's connection takes no answers, the worker stops reading new messages (backpressure) instead
of queueing every one, and once the connection takes them again every answer comes back, in order (the
bound cannot deadlock: the answering task never waits on the reading one)."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from asyncengine.runtime.dedicated_thread import DedicatedThread
from asyncengine.wire.messages import Shutdown, WorkerCall, WorkerCallResult
from asyncengine.worker.process import ANSWERS_BOUND, _serve_messages

pytestmark = pytest.mark.anyio


class _HeldConnection:
    """The engine core's end: hands over the messages as fast as asked, takes answers once released."""

    def __init__(self, messages: list) -> None:
        self._messages = iter(messages)
        self.received = 0
        self.sent: list = []
        self.release = anyio.Event()

    async def receive(self):
        await anyio.lowlevel.checkpoint()
        self.received += 1
        return next(self._messages)

    async def send(self, message) -> None:
        await self.release.wait()
        self.sent.append(message)


class _Worker:
    extension = None

    def echo(self, value: int) -> int:
        return value

    def shutdown(self) -> None:
        pass


async def test_a_connection_that_takes_no_answers_stops_the_reading_and_every_answer_comes_back():
    count = 3 * ANSWERS_BOUND
    connection = _HeldConnection([WorkerCall(call_id=i, method="echo", args=[i]) for i in range(count)] + [Shutdown()])
    thread = DedicatedThread("test-worker")

    async def serve() -> None:
        try:
            await _serve_messages(connection, _Worker(), thread)
        finally:
            thread.close()

    with anyio.fail_after(60):  # generous: only a deadlock gets near it
        async with anyio.create_task_group() as tg:
            await tg.start(thread.serve)
            tg.start_soon(serve)
            await anyio.wait_all_tasks_blocked()  # the reader has stopped: the queue is full (or all is read)
            read_while_held = connection.received
            connection.release.set()
    # The queue, the one answer being sent and the one message waiting for room: no more was read.
    assert read_while_held <= ANSWERS_BOUND + 2, f"read {read_while_held} of {count} messages with no answer taken"
    assert [answer.call_id for answer in connection.sent] == list(range(count))
    assert all(isinstance(answer, WorkerCallResult) and answer.result == answer.call_id for answer in connection.sent)
