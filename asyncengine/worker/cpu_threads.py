"""The model's CPU threads: how many (`cpu_threads`, `--cpu-threads`) and which cores they run on.

Default: the CPUs this process may run on (its affinity mask, which a container or `taskset` may
narrow below the machine's count), shared evenly among the workers of the engine (and of the other
data-parallel engine cores on this host: `local_workers`), and at most torch's
count (its default is the physical cores; OMP_NUM_THREADS or torch.set_num_threads may have lowered it);
nothing pinned. A worker sets torch's intra-op thread count
on its own thread (the OpenMP threads torch starts from that thread serve the model, and the C decode
kernel reads the same count).

When `cpu_threads` is given and leaves CPUs spare (fewer threads than the CPUs of the mask), the worker's
thread is pinned to its own cores (the first of the mask, one run per rank), and so are the OpenMP
threads it starts, which inherit its mask; every other thread of the process (the event loop, the
tokenizer pool, the engine core's helpers, and the threads they start later) is moved to the CPUs the
model does not use, so an event-loop wake-up never preempts a thread of a matmul that the others then
wait for. With no CPU spare nothing is pinned: there is nowhere else to put that work.
The worker puts every mask and the thread count back when it shuts down (an in-process engine must
not leave the process it ran in pinned).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

import torch

from asyncengine.errors import ConfigError

logger = logging.getLogger(__name__)


def available_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def local_workers(rank: int, world_size: int, data_parallel_rank: int, data_parallel_size: int,
                  executor_backend: str | None) -> tuple[int, int]:
    """(this worker's index, how many workers share this host's CPUs): the engine's ranks, times the
    data-parallel engine cores when they all run here. A Ray executor places ranks on other nodes too,
    where this host's count says nothing: there only the engine's own ranks are counted."""
    if data_parallel_size <= 1 or executor_backend == "ray":
        return rank, world_size
    return data_parallel_rank * world_size + rank, data_parallel_size * world_size


@dataclass(frozen=True)
class ThreadPlan:
    threads: int  # torch's intra-op threads for this worker
    model_cpus: tuple[int, ...] | None  # pin the worker's thread here; None: no pinning
    other_cpus: tuple[int, ...] | None  # the process's other threads go here (with model_cpus)

    def describe(self) -> str:
        if self.model_cpus is None:
            return f"{self.threads} model threads, not pinned"
        return (f"{self.threads} model threads pinned to CPUs {_ranges(self.model_cpus)}; the process's other "
                f"threads on CPUs {_ranges(self.other_cpus or ())}")


def plan_threads(cpu_threads: int | None, rank: int, world_size: int, cpus: list[int],
                 torch_default_threads: int) -> ThreadPlan:
    """What a worker of `rank` among `world_size` workers on these CPUs should use."""
    if cpu_threads is not None and cpu_threads < 1:
        raise ConfigError(f"cpu_threads must be at least 1 when given, got {cpu_threads}", field="cpu_threads")
    share = max(1, len(cpus) // max(1, world_size))
    if cpu_threads is None:
        # The default pins nothing, and keeps torch's count where it is lower: physical cores on a CPU
        # with two hardware threads per core (siblings share one core's units), or what the user set.
        return ThreadPlan(min(share, torch_default_threads), None, None)
    threads = cpu_threads
    used = threads * world_size
    if used >= len(cpus):
        if used > len(cpus):
            logger.warning("cpu_threads=%d for each of %d workers asks for %d threads on %d CPUs: threads will "
                           "wait for each other (fewer threads are usually faster)", threads, world_size, used,
                           len(cpus))
        return ThreadPlan(threads, None, None)
    model = tuple(cpus[rank * threads:(rank + 1) * threads])
    other = tuple(cpus[used:])
    return ThreadPlan(threads, model, other)


@dataclass
class AppliedThreads:
    """What `apply` changed, for `restore`."""

    plan: ThreadPlan
    previous_threads: int
    previous_masks: dict[int, set[int]] = field(default_factory=dict)  # thread id -> its CPU mask before


def apply(plan: ThreadPlan) -> AppliedThreads:
    """Apply `plan` from the worker's own thread (the thread that will run the model)."""
    applied = AppliedThreads(plan, torch.get_num_threads())
    if plan.threads != applied.previous_threads:
        torch.set_num_threads(plan.threads)
    if plan.model_cpus is None or plan.other_cpus is None:
        return applied
    me = threading.get_native_id()
    for tid in _thread_ids():
        target = set(plan.model_cpus) if tid == me else set(plan.other_cpus)
        try:
            applied.previous_masks[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, target)
        except (ProcessLookupError, PermissionError) as exc:  # a thread that ended meanwhile, or a sandbox
            applied.previous_masks.pop(tid, None)
            logger.debug("could not move thread %d to CPUs %s: %s", tid, sorted(target), exc)
    logger.info("CPU threads: %s", plan.describe())
    return applied


def restore(applied: AppliedThreads) -> None:
    """Put the thread count and the masks `apply` changed back (threads started since keep theirs)."""
    if torch.get_num_threads() != applied.previous_threads:
        torch.set_num_threads(applied.previous_threads)
    for tid, mask in applied.previous_masks.items():
        try:
            os.sched_setaffinity(tid, mask)
        except (ProcessLookupError, PermissionError):  # ended since: nothing to put back
            pass
    applied.previous_masks.clear()


def report(applied: AppliedThreads | None) -> dict | None:
    """What the calling thread (the worker's) runs with now: torch's thread count and its CPU mask."""
    if applied is None:
        return None
    return {"threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0)),
            "plan": applied.plan.describe()}


def _thread_ids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: only the calling thread is known
        return [threading.get_native_id()]


def _ranges(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
