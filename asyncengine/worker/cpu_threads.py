"""The model's CPU threads: how many (`cpu_threads`, `--cpu-threads`) and which cores they run on.

Default: the CPUs this process may run on (its affinity mask, which a container or `taskset` may
narrow below the machine's count), less those other processes keep busy when the worker starts
(`busy_cpus`: /proc/stat over a fifth of a second, this process's own time left out), shared evenly among
the workers of the engine (and of the other data-parallel engine cores on this host: `local_workers`),
and at most torch's count (its default is the physical cores; OMP_NUM_THREADS or torch.set_num_threads
may have lowered it); nothing pinned. Why the busy CPUs are left out: a step splits its work evenly among
its threads and waits for the last, so a thread that shares its core with another process's busy loop
gets half that core and the whole step runs at its pace; on two cores with one busy, one thread on the
free core decodes faster than two (bench/RESULTS.md, issue 36). A worker sets torch's intra-op thread count
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
import time
from typing import Any
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


def busy_cpus(cpus: list[int], interval: float = 0.2) -> float:
    """How many of `cpus` other processes kept busy over the next `interval` seconds: the CPUs' busy time
    (/proc/stat) less this process's own (its CPU seconds), in CPUs. 0.0 where /proc cannot be read."""
    before = _sample(cpus)
    time.sleep(interval)
    return _others_busy(cpus, before, _sample(cpus))


Sample = tuple[list[tuple[int, int]] | None, float | None]


def _sample(cpus: list[int]) -> Sample:
    return _cpu_times(cpus), _own_seconds()


def _others_busy(cpus: list[int], before: Sample, after: Sample) -> float:
    """The CPUs other processes kept busy between two samples (0.0 when either could not be read)."""
    (times_before, own_before), (times_after, own_after) = before, after
    if times_before is None or times_after is None or own_before is None or own_after is None:
        return 0.0
    busy = sum(a[0] - b[0] for a, b in zip(times_after, times_before)) / _TICKS
    total = sum(a[1] - b[1] for a, b in zip(times_after, times_before)) / _TICKS
    if total <= 0:
        return 0.0
    return min(float(len(cpus)), len(cpus) * max(0.0, busy - (own_after - own_before)) / total)


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_times(cpus: list[int]) -> list[tuple[int, int]] | None:
    """(busy ticks, all ticks) of each of `cpus`, from /proc/stat."""
    wanted, found = {f"cpu{cpu}" for cpu in cpus}, []
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                fields = line.split()
                if fields and fields[0] in wanted:
                    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
                    found.append((sum(ticks) - ticks[3] - ticks[4], sum(ticks)))
    except (OSError, ValueError):
        return None
    return found if len(found) == len(wanted) else None


def _own_seconds() -> float | None:
    """This process's CPU seconds so far (every thread, user and system)."""
    try:
        times = os.times()
    except OSError:
        return None
    return times.user + times.system


@dataclass(frozen=True)
class ThreadPlan:
    threads: int  # torch's intra-op threads for this worker
    model_cpus: tuple[int, ...] | None  # pin the worker's thread here; None: no pinning
    other_cpus: tuple[int, ...] | None  # the process's other threads go here (with model_cpus)
    busy: float = 0.0  # CPUs other processes kept busy at start (default plan only)

    def describe(self) -> str:
        if self.model_cpus is None:
            seen = f" ({self.busy:.1f} CPUs busy with other processes at start)" if self.busy >= 0.05 else ""
            return f"{self.threads} model threads, not pinned{seen}"
        return (f"{self.threads} model threads pinned to CPUs {_ranges(self.model_cpus)}; the process's other "
                f"threads on CPUs {_ranges(self.other_cpus or ())}")


def plan_threads(cpu_threads: int | None, rank: int, world_size: int, cpus: list[int],
                 torch_default_threads: int, busy: float = 0.0) -> ThreadPlan:
    """What a worker of `rank` among `world_size` workers on these CPUs should use; `busy`: how many of
    them other processes keep busy (`busy_cpus`), which the default leaves to them."""
    if cpu_threads is not None and cpu_threads < 1:
        raise ConfigError(f"cpu_threads must be at least 1 when given, got {cpu_threads}", field="cpu_threads")
    share = max(1, len(cpus) // max(1, world_size))
    if cpu_threads is None:
        # The default pins nothing, and keeps torch's count where it is lower: physical cores on a CPU
        # with two hardware threads per core (siblings share one core's units), or what the user set.
        # A CPU counts as taken when others keep it busy more than half the time.
        free = max(1, int(len(cpus) - busy + 0.5))
        return ThreadPlan(min(share, max(1, free // max(1, world_size)), torch_default_threads), None, None,
                          round(busy, 2))
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


class LoadFollower:
    """The default plan kept up to date while the engine runs: every `period` seconds (checked between
    steps, from /proc/stat's counts since the last check, no waiting) the CPUs other processes keep busy
    are counted again and torch's thread count set to what `plan_threads` would choose now. A busy loop
    that starts after the engine (or stops) changes the thread count within a period or two."""

    def __init__(self, cpus: list[int], world_size: int, torch_default_threads: int, period: float = 2.0) -> None:
        self.cpus, self.world_size, self.torch_default = cpus, world_size, torch_default_threads
        self.period = period
        self._sample = _sample(cpus)
        self._next = time.monotonic() + period

    def poll(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.period
        before, self._sample = self._sample, _sample(self.cpus)
        others = _others_busy(self.cpus, before, self._sample)
        threads = plan_threads(None, 0, self.world_size, self.cpus, self.torch_default, others).threads
        if threads != torch.get_num_threads():
            logger.info("CPU threads: %d -> %d (%.1f of %d CPUs busy with other processes)",
                        torch.get_num_threads(), threads, others, len(self.cpus))
            torch.set_num_threads(threads)


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


def report(applied: AppliedThreads | None) -> dict[str, Any] | None:
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
