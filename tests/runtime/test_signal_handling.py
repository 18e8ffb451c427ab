"""runtime/signals.py in-process: the first signal drains, a second cuts the drain short, SIGTERM stops a
child at once; a signal sent once `tg.start(...)` has returned is handled. (test_signals.py runs a real
serving process end to end.)"""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from asyncengine.runtime.signals import drain_on_signal, stop_now_on_sigterm, stop_on_signals

pytestmark = pytest.mark.anyio

TIMEOUT = 30.0  # generous: only a broken handler waits this long


async def test_the_first_signal_drains_and_a_second_cuts_the_drain_short():
    said: list[str] = []
    drain_started, drain_ended = anyio.Event(), []

    async def drain() -> None:
        drain_started.set()
        try:
            await anyio.sleep_forever()  # a drain that would never end by itself
        finally:
            drain_ended.append(True)

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(lambda task_status: drain_on_signal(
                drain, announce=lambda name: said.append(f"first {name}"),
                announce_again=lambda name: said.append(f"again {name}"), task_status=task_status))
            os.kill(os.getpid(), signal.SIGTERM)
            await drain_started.wait()
            os.kill(os.getpid(), signal.SIGINT)
    assert said == ["first SIGTERM", "again SIGINT"]
    assert drain_ended == [True]


class _Engine:
    def __init__(self) -> None:
        self.grace_periods: list[float] = []

    async def shutdown(self, grace_period: float) -> None:
        self.grace_periods.append(grace_period)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_stop_on_signals_shuts_the_engine_down_then_cancels_the_scope(sig):
    engine = _Engine()
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(stop_on_signals, engine, tg.cancel_scope, 7.0)
            os.kill(os.getpid(), sig)
            await anyio.sleep_forever()  # the handler cancels this scope
    assert engine.grace_periods == [7.0]


async def test_sigterm_stops_a_child_at_once():
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(stop_now_on_sigterm, tg.cancel_scope)
            os.kill(os.getpid(), signal.SIGTERM)
            await anyio.sleep_forever()
