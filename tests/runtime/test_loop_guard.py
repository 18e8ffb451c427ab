"""The event-loop guard itself: it must fire on a blocking call, and stay quiet otherwise."""

from __future__ import annotations

import time

import anyio
import pytest

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend(request):
    from support.loop_guard import LoopBlockingGuard

    guard = LoopBlockingGuard(threshold=0.05)
    request.node.loop_guard = guard
    return ("trio", {"instruments": [guard]})


async def test_guard_fires_on_a_blocking_call(request):
    request.node.expect_blocked_loop = True  # this test blocks on purpose; teardown must not fail it
    await anyio.sleep(0)
    time.sleep(0.2)  # a blocking call on the event loop
    await anyio.sleep(0)
    violations = request.node.loop_guard.violations
    assert violations and violations[0][1] >= 0.2
    assert "ran 200 ms" in request.node.loop_guard.report() or "without yielding" in request.node.loop_guard.report()


async def test_guard_is_quiet_when_the_loop_only_awaits(request):
    for _ in range(10):
        await anyio.sleep(0.01)
    await anyio.to_thread.run_sync(time.sleep, 0.2)  # blocking work belongs in a thread
    assert request.node.loop_guard.violations == []
