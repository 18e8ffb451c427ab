"""A step's grammar masks that reach the worker after the step was submitted (vLLM's split step).

With async scheduling the engine core submits step N+1 while step N runs. A constrained request in
N+1 needs a mask that depends on the token it samples in N, unknown at submission. Instead of holding
constrained requests back until N is folded in (which gives up the overlap), the engine core submits
N+1 with `SchedulerOutput.deferred_grammar_request_ids` set and a `DeferredMask`; the worker runs
N+1's forward pass and waits on the mask only when it is about to sample, while the engine core folds
in N, advances the matchers and `set`s N+1's masks. The forward pass overlaps all of that.

The executor says it takes masks late with `supports_deferred_grammar` and hands them over with
`deliver_masks`: UniExecutor sets the DeferredMask its worker's thread waits on; MultiprocExecutor (and
so the Ray executor) sends each rank a GrammarMasks frame, which the rank's process sets on its own
DeferredMask for that step (worker/process.py: one per deferred step, in order). An executor or worker
class whose methods predate the `grammar` argument does not take them (`takes_grammar`), and then
constrained requests sit out instead (StructuredOutputManager.sits_out).
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

from asyncengine.wire.worker import GrammarBitmask


class DeferredMaskCancelled(RuntimeError):
    """The engine core stopped before it could compute the masks a submitted step waits for."""


class DeferredMask:
    """Set once by the engine core's step loop, waited on by the worker's thread."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._bitmask: GrammarBitmask | None = None
        self._cancelled = False

    @property
    def is_set(self) -> bool:
        return self._ready.is_set()

    def set(self, bitmask: GrammarBitmask | None) -> None:
        """The step's masks (None: none of its requests is constrained any more)."""
        self._bitmask = bitmask
        self._ready.set()

    def cancel(self) -> None:
        """Release a worker waiting on masks that will never come (the step loop is stopping)."""
        if not self._ready.is_set():
            self._cancelled = True
            self._ready.set()

    def wait(self) -> GrammarBitmask | None:
        self._ready.wait()
        if self._cancelled:
            raise DeferredMaskCancelled("the engine core stopped before this step's grammar masks were computed")
        return self._bitmask


def takes_grammar(function: Any) -> bool:
    """Whether `function` (an executor's submit_step, a worker's execute_model) accepts `grammar=`."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a callable without a signature: do not guess
        return False
    return "grammar" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
