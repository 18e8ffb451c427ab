"""CountingScheduler: vLLM's scheduler, counting the steps it schedules (noted once, at the first)."""

from vllm.v1.core.sched.scheduler import Scheduler

from vllm_shaped_platform import note


class CountingScheduler(Scheduler):
    steps = 0

    def schedule(self, *args, **kwargs):
        CountingScheduler.steps += 1
        if CountingScheduler.steps == 1:
            note("scheduled")
        return super().schedule(*args, **kwargs)
