"""SchedulerInterface: what the engine core asks of its scheduler (`scheduler_cls`, docs/reference.md, C1).

vLLM's shape (vllm/v1/core/sched/interface.py), with the methods our engine core calls. The built-in
`Scheduler` (asyncengine/engine_core/scheduler.py) implements it; a `scheduler_cls` may subclass
`Scheduler`, subclass this interface, or implement every method below without subclassing anything
(a class that wraps the built-in one, say). Start-up checks the class (`scheduler_class_problem`) and
names each method it lacks.

The engine core builds the scheduler with keyword arguments only, the same for every class:

- `block_manager`: the KV-cache blocks (asyncengine/engine_core/block_manager.py), already sized;
- `max_num_seqs`, `max_num_batched_tokens`, `max_model_len`, `enable_chunked_prefill`: the config's limits;
- `policy`: "fcfs" or "priority" (`scheduling_policy`);
- `structured_output`: the StructuredOutputManager (grammars and their masks);
- `kv_connector`: the KV connector's scheduler side, or None (`kv_transfer_config`);
- `max_loras`: at most this many adapters among running requests, or None without LoRA;
- `micro_batches`: pipeline micro-batch rules (asyncengine/engine_core/micro_batches.py), or None.

Async scheduling belongs to the engine core's step loop: with it on, `schedule()` is called for step N+1
while step N runs, before `update_from_output` folds step N's sampled tokens in. The built-in scheduler
counts those tokens as pending; a scheduler that does not delegate to it must do the same, or run with
`async_scheduling=False` (start-up logs this once for any `scheduler_cls`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any


class SchedulerInterface(ABC):
    # What the methods take and give, by the names of the wire types (asyncengine.wire, not imported by the
    # interfaces): `request` an EngineCoreRequest, `scheduler_output` a SchedulerOutput and
    # `model_runner_output` a ModelRunnerOutput (wire.worker); update_from_output gives EngineCoreOutputs,
    # fail_request an EngineCoreOutput, make_stats SchedulerStats (wire.engine_core), get_grammar_bitmask a
    # GrammarBitmask (wire.worker).

    @abstractmethod
    def add_request(self, request: Any) -> None:
        """Queue a new request (its `request_id` is new to the scheduler)."""

    @abstractmethod
    def schedule(self) -> Any:
        """One step: the tokens of each request to run now (`num_scheduled_tokens`), the requests the
        workers see for the first time, those they must forget, and the grammar masks of the step."""

    @abstractmethod
    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """Fold a step's sampled tokens (and pooled outputs, and requests a worker refused) in; the
        outputs to send to the frontend, with `make_stats()` as their scheduler_stats."""

    @abstractmethod
    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: str) -> list[str]:
        """End these requests (all of them for None) with `finished_status` (a FinishReason: "abort" when
        the frontend aborts, or a stop string ended it there), freeing their blocks; unknown ids are
        ignored (a request may have finished a moment earlier). The ids it ended."""

    @abstractmethod
    def fail_request(self, request_id: str, message: str, field: str | None) -> Any:
        """End one request with finish_reason "error" (its grammar was refused, or broke); its output,
        or None when it is gone already."""

    @abstractmethod
    def get_grammar_bitmask(self, scheduler_output: Any) -> Any:
        """The grammar masks of a step whose masks were deferred (`deferred_grammar_request_ids`), from the
        matchers' state now: the step loop asks once the step before it has been folded in."""

    @abstractmethod
    def get_num_unfinished_requests(self) -> int:
        """Requests added and not finished (waiting or running)."""

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def has_finished_requests(self) -> bool:
        """Whether requests finished since the last `schedule()` (the next step tells the workers to
        forget them). Not the same as `not has_unfinished_requests()`."""

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    @abstractmethod
    def make_stats(self) -> Any:
        """The scheduler's state for the stat loggers and /metrics, made at every step."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes no running request holds; True when done."""

    @abstractmethod
    def shutdown(self) -> None:
        """The step loop has ended: release what the scheduler holds."""


# Every method the engine core may call: a class that does not subclass the interface needs each of them.
SCHEDULER_METHODS = tuple(sorted(name for name, value in vars(SchedulerInterface).items()
                                 if callable(value) and not name.startswith("_")))


def missing_scheduler_methods(cls: type) -> list[str]:
    """The methods of SchedulerInterface that `cls` lacks or leaves abstract."""
    abstract: frozenset[str] = getattr(cls, "__abstractmethods__", frozenset())
    return [name for name in SCHEDULER_METHODS if not callable(getattr(cls, name, None)) or name in abstract]


def scheduler_class_problem(value: Any) -> str | None:
    """What is wrong with `value` as a `scheduler_cls`, or None (config hooks, docs/reference.md C1)."""
    if not isinstance(value, type):
        return (f"is {value!r}, not a class; name a subclass of asyncengine.plugins_api.Scheduler or a class "
                "implementing asyncengine.plugins_api.SchedulerInterface")
    missing = missing_scheduler_methods(value)
    if missing:
        return (f"is not a subclass of asyncengine.engine_core.scheduler:Scheduler; subclass "
                f"asyncengine.plugins_api.Scheduler, or implement every method of "
                f"asyncengine.plugins_api.SchedulerInterface: {value.__qualname__} lacks {', '.join(missing)}")
    return None


__all__ = ["SCHEDULER_METHODS", "SchedulerInterface", "missing_scheduler_methods", "scheduler_class_problem"]
