"""Batch-level logits processors (vLLM v1's design): the bookkeeping a worker keeps to produce each
processor's BatchUpdate, and the processors one worker built. The interface (LogitsProcessor,
BatchUpdate and its parts) is in the floor, asyncengine.interfaces.logits; imported here too.

Processors come from the entry-point group `asyncengine.logits_processors` and from the
`logits_processors` option (both end up in PluginState.logits_processors, each class once). The
frontend calls each class's `validate_params(params)` per request; every worker builds one instance
of each class when it loads the model and, before sampling a step, calls `update_state(batch_update)`
then `apply(logits)`. docs/logits_processors.md is the user-facing description.

Rows. The logits a processor sees hold one row per request that samples this step (a request whose
prompt is still being prefilled in chunks, or that is not scheduled this step, has no row). A row
index is stable for as long as its request keeps sampling step after step: the worker keeps a
persistent layout, fills the rows freed by leaving requests with arriving ones, and closes the
remaining gaps by moving the last rows down (MoveDirectionality.UNIDIRECTIONAL). Processors apply a
BatchUpdate's `removed` and `added` (disjoint sets of indices, so in either order), then `moved` in
list order, exactly as vLLM's built-in processors do.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from asyncengine.interfaces.logits import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
)

if TYPE_CHECKING:
    from asyncengine.config.engine import EngineConfig


_Key = TypeVar("_Key", bound=Hashable)


class PersistentBatch(Generic[_Key]):
    """The row layout of the sampled batch, carried from step to step, and the BatchUpdate that
    takes a processor from the previous layout to the next one.

    Keys are hashable and compared by equality; the model runner uses its per-request state object
    (hashed by identity), so a request that left the worker and came back (preempted and resumed)
    is a new key, announced again with its new token lists.
    """

    def __init__(self) -> None:
        self.rows: list[_Key] = []

    def step(self, keys: Sequence[_Key],
             describe: Callable[[_Key], tuple[Any, list[int], list[int]]]) -> BatchUpdate | None:
        """Lay out `keys` (the requests sampling this step, any order) and return the update, or None
        when the layout did not change. Afterwards `rows` lists the keys in row order.

        `describe(key)` gives (params, prompt_token_ids, output_token_ids) of an arriving key."""
        wanted = set(keys)
        if len(wanted) != len(keys):
            raise ValueError("a request appears twice in one step's batch")
        previous = self.rows
        rows: list[_Key | None] = [key if key in wanted else None for key in previous]
        holes = deque(index for index, key in enumerate(rows) if key is None)
        present = set(previous)
        added = []
        for key in keys:
            if key in present:
                continue
            if holes:  # lowest free row first, so the batch stays dense
                index = holes.popleft()
                rows[index] = key
            else:
                index = len(rows)
                rows.append(key)
            params, prompt_token_ids, output_token_ids = describe(key)
            added.append(AddedRequest(index, params, prompt_token_ids, output_token_ids))
        removed = list(holes)
        moved = []
        while True:  # close the gaps: the last row moves into the lowest free one
            while rows and rows[-1] is None:
                rows.pop()
            while holes and holes[-1] >= len(rows):
                holes.pop()
            if not holes:
                break
            hole, last = holes.popleft(), len(rows) - 1
            rows[hole], rows[last] = rows[last], None
            moved.append(MovedRequest(last, hole, MoveDirectionality.UNIDIRECTIONAL))
        self.rows = [key for key in rows if key is not None]  # every gap is closed: the same list, typed
        if not (added or removed or moved):
            return None
        return BatchUpdate(batch_size=len(rows), removed=removed, added=added, moved=moved)


class LogitsProcessorError(RuntimeError):
    """A logits processor raised, or returned something other than logits, in a worker."""


class LogitsProcessorRequestError(Exception):
    """A logits processor refused one request in the worker (`check_request`): that request fails."""

    def __init__(self, message: str, *, source: LogitsProcessor, error: Exception) -> None:
        super().__init__(message)
        self.source = source
        self.error = error


def processor_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


class LogitsProcessors:
    """The processors one worker built, with the row layout that feeds them."""

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = list(processors)
        # Asked once: vLLM also sorts processors into these two lists when it builds them.
        self.argmax_invariant = [p for p in self.processors if p.is_argmax_invariant()]
        self.non_argmax_invariant = [p for p in self.processors if p not in self.argmax_invariant]
        self.batch: PersistentBatch[Any] = PersistentBatch()  # keyed by the model runner's request states

    @classmethod
    def build(cls, classes: Sequence[type], engine_config: EngineConfig, device: Any,
              is_pin_memory: bool) -> "LogitsProcessors | None":
        """One instance per class; None when there are none (the runner then keeps no layout at all)."""
        from asyncengine.errors import StartupError

        built = []
        for processor_cls in classes:
            try:
                built.append(processor_cls(engine_config, device, is_pin_memory))
            except Exception as exc:  # plugin code: fail start-up naming the class
                raise StartupError(
                    f"logits processor {processor_name(processor_cls)} could not be built: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        return cls(built) if built else None

    def check_request(self, params: Any) -> None:
        """Each processor's `check_request`; the first refusal as a LogitsProcessorRequestError."""
        for processor in self.processors:
            try:
                processor.check_request(params)
            except Exception as exc:  # plugin code refused (or failed on) one request: that request fails
                raise LogitsProcessorRequestError(
                    f"logits processor {processor_name(type(processor))} refused the request in check_request(): "
                    f"{type(exc).__name__}: {exc}", source=processor, error=exc,
                ) from exc

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        for processor in self.processors:
            try:
                processor.update_state(batch_update)
            except Exception as exc:  # named, then the step fails (the engine reports the worker)
                raise _failed(processor, "update_state", exc) from exc

    def apply(self, logits: Any, *, argmax_invariant: bool) -> Any:
        for processor in self.argmax_invariant if argmax_invariant else self.non_argmax_invariant:
            try:
                result = processor.apply(logits)
            except Exception as exc:
                raise _failed(processor, "apply", exc) from exc
            shape = getattr(result, "shape", None)
            if shape != logits.shape:
                raise LogitsProcessorError(
                    f"logits processor {processor_name(type(processor))}: apply() returned "
                    f"{type(result).__name__} of shape {shape}, not logits of shape {tuple(logits.shape)}"
                )
            logits = result
        return logits


def _failed(processor: LogitsProcessor, method: str, exc: Exception) -> LogitsProcessorError:
    return LogitsProcessorError(
        f"logits processor {processor_name(type(processor))} raised in {method}(): {type(exc).__name__}: {exc}"
    )


def merge_processor_classes(*sources: Sequence[type]) -> list[type]:
    """The classes of every source in order, each once (the same class from the entry point and the
    option is built once)."""
    merged: list[type] = []
    for source in sources:
        for cls in source:
            if cls not in merged:
                merged.append(cls)
    return merged
