"""AdmissionGate: the bound on requests waiting for the engine core (`max_waiting_requests`).

A request holds one place per engine-core request (n completions take n places) from the moment it
is queued until the scheduler first runs it, or until it finishes or is aborted. `enter` waits for
room (backpressure); `try_enter` is the `nowait` form.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio


class AdmissionGate:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.count = 0
        self._changed = anyio.Event()
        self._error: BaseException | None = None

    def try_enter(self, places: int) -> bool:
        if self._error is not None:
            raise self._error
        if self.count + places > self.capacity:
            return False
        self.count += places
        return True

    async def enter(self, places: int, still_wanted: Callable[[], bool] = lambda: True) -> bool:
        """Wait for room and take it (True), or return False once `still_wanted()` turns false
        (the request was aborted while it waited: `wake()` makes waiters look again)."""
        while still_wanted():
            if self.try_enter(places):
                return True
            await self._changed.wait()
        return False

    def wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def leave(self, places: int) -> None:
        self.count -= places
        self.wake()

    def fail(self, error: BaseException) -> None:
        """Wake every waiter with `error` (the engine died or shut down)."""
        self._error = error
        self._changed.set()
