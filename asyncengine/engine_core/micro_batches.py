"""Pipeline parallelism with several micro-batches in flight (vLLM's virtual engines), the engine core's part.

With P pipeline stages and async scheduling the step loop keeps P steps in the executor (`steps_in_flight`),
and the scheduler makes them micro-batches that can overlap: while the last stage runs step N, the first
stage runs step N+1 on other requests. On by default off CPU (`micro_batches_for` says when).

Two rules make that correct and useful (`MicroBatches`, held by the scheduler as `micro_batches`):

- A sequence whose sampled token is still in flight sits out (plain async scheduling schedules it again at
  once, because its single worker knows the token by the next step; the first stage of a pipeline does not,
  the last stage sampled it). A prompt chunk with no token to sample may follow itself: every stage runs
  the steps in order.
- At most ceil(running / P) running sequences per step, so the sequences split into P groups that take
  turns (without the cap the first step takes them all and the next finds none: no overlap).

The tokens then travel from the engine core, not from the last stage: each step's `pipeline_token_ids`
holds, per cached request, its tokens from max(num_computed_tokens, prompt length) on (one token per
decode step), which the stages that did not sample append (worker/pipeline.py). The last stage's
broadcast of its sampled tokens, which held every stage until the last had sampled, is skipped. Without
micro-batches nothing here is used and the broadcast stays.

What still does not overlap: the first stage's send of step N+1's activations waits until the last stage
takes them, after it finished step N (gloo's send meets its receive); and the engine core's scheduling
of step N+P waits for step N's output. `bench/distributed.py` measures each stage's idle fraction.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from asyncengine.config.engine import EngineConfig
from asyncengine.errors import ConfigError

if TYPE_CHECKING:
    from asyncengine.engine_core.sequence import Sequence
    from asyncengine.wire.worker import CachedRequestData


MICRO_BATCHES_ENV = "ASYNCENGINE_PIPELINE_MICRO_BATCHES"


def micro_batches_for(engine_config: EngineConfig, device_type: str | None) -> MicroBatches | None:
    """The scheduler's micro-batch rules when the pipeline has stages to overlap, else None.

    On by default, on CPU too: on a quiet 2-core host, whose stages share its cores and memory, PP=2 with
    them ran W3 at 1.15-1.41x the throughput of PP=2 without (bench/RESULTS.md, "Distributed ... evening";
    an earlier run on a loaded machine had shown the opposite). ASYNCENGINE_PIPELINE_MICRO_BATCHES=0 turns
    them off (one step through the stages at a time), =1 on."""
    if engine_config.pipeline_parallel_size == 1 or not engine_config.async_scheduling:
        return None
    chosen = os.environ.get(MICRO_BATCHES_ENV, "")
    if chosen not in ("", "0", "1"):
        raise ConfigError(f"{MICRO_BATCHES_ENV}={chosen!r}: set it to 1 (micro-batches) or 0 (one step through "
                          "the stages at a time), or leave it unset", field="pipeline_parallel_size")
    if chosen == "0":
        return None
    return MicroBatches(engine_config.pipeline_parallel_size)


def steps_in_flight(engine_config: EngineConfig, micro_batches: MicroBatches | None) -> int:
    """How many steps the step loop keeps in the executor: one per stage with micro-batches, two with
    async scheduling, else one."""
    if micro_batches is not None:
        return max(2, micro_batches.num_stages)
    return 2 if engine_config.async_scheduling else 1


class MicroBatches:
    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self._limit = 0
        self._taken = 0

    def begin_step(self, num_running: int) -> None:
        """Before the scheduler walks its running sequences for a step."""
        self._limit = -(-num_running // self.num_stages)
        self._taken = 0

    def sits_out(self, seq: Sequence) -> bool:
        """Whether the running sequence `seq` stays out of this step (asked once, before it is scheduled)."""
        if seq.num_pending_tokens or self._taken >= self._limit:
            return True
        self._taken += 1
        return False

    @staticmethod
    def token_ids(cached: list[CachedRequestData], sequences: dict[str, Sequence]) -> dict[str, list[int]]:
        """Per cached request of the step, its tokens the stages that did not sample may lack."""
        result = {}
        for data in cached:
            seq = sequences[data.request_id]
            result[data.request_id] = seq.token_ids[max(data.num_computed_tokens, seq.num_prompt_tokens):]
        return result


__all__ = ["MicroBatches", "micro_batches_for", "steps_in_flight"]
