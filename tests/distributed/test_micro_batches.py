"""Pipeline micro-batches (engine_core/micro_batches.py), the scheduler's side, in-process with fake stages.

The step loop keeps two steps in flight (PP=2, async scheduling). A fake first stage never samples: it
knows a request's tokens only from its prompt and the steps' `pipeline_token_ids`, and must find, for every
token it computes, the token the last stage sampled there. A fake last stage runs the steps in order and
samples. Checked: no request is in two steps in flight when it samples in the first; the running
requests split into groups that take turns (two non-empty steps in flight); every input the first stage
builds is right; the outputs are those of one step at a time.
"""

from __future__ import annotations

from collections import deque

from asyncengine import EngineConfig
from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.micro_batches import (
    MICRO_BATCHES_ENV,
    MicroBatches,
    micro_batches_for,
    steps_in_flight,
)
from asyncengine.engine_core.scheduler import Scheduler
from asyncengine.wire.engine_core import EngineCoreRequest, SamplingOptions
from asyncengine.wire.worker import ModelRunnerOutput, SchedulerOutput

PROMPTS = {f"r{i}": list(range(10 * i + 1, 10 * i + 4 + i)) for i in range(6)}  # 3 to 8 tokens
MAX_TOKENS = 6


def sampled(request_id: str, index: int) -> int:
    return 1000 + 100 * int(request_id[1:]) + index


class FirstStage:
    """Builds each step's input tokens from what the scheduler sent, as a stage that does not sample."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def run(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for request_id in out.finished_request_ids:
            self.tokens.pop(request_id, None)
        for new in out.new_requests:
            self.tokens[new.request_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.computed[new.request_id] = new.num_computed_tokens
        for cached in out.cached_requests:
            self.computed[cached.request_id] = cached.num_computed_tokens
        assert out.pipeline_token_ids is not None, "no tokens for the stages that do not sample"
        for request_id, tokens in out.pipeline_token_ids.items():
            start = max(self.computed[request_id], len(PROMPTS[request_id]))
            del self.tokens[request_id][start:]
            self.tokens[request_id].extend(tokens)
        inputs = {}
        for request_id, n in out.num_scheduled_tokens.items():
            start = self.computed[request_id]
            inputs[request_id] = self.tokens[request_id][start:start + n]
            assert len(inputs[request_id]) == n, f"{request_id}: the first stage lacks tokens it must compute"
            self.computed[request_id] = start + n
        return inputs


class LastStage:
    def __init__(self) -> None:
        self.tokens = {request_id: list(prompt) for request_id, prompt in PROMPTS.items()}
        self.computed = dict.fromkeys(PROMPTS, 0)

    def run(self, out: SchedulerOutput, first_stage_inputs: dict[str, list[int]]) -> ModelRunnerOutput:
        output = ModelRunnerOutput()
        for request_id in out.finished_request_ids:
            self.computed[request_id] = 0  # (a preempted request is recomputed from its start)
        for request_id, n in out.num_scheduled_tokens.items():
            start = self.computed[request_id]
            assert first_stage_inputs[request_id] == self.tokens[request_id][start:start + n], request_id
            self.computed[request_id] = start + n
            if start + n == len(self.tokens[request_id]):
                token = sampled(request_id, len(self.tokens[request_id]) - len(PROMPTS[request_id]))
                self.tokens[request_id].append(token)
                output.request_ids.append(request_id)
                output.sampled_token_ids.append(token)
        return output


def test_two_micro_batches_in_flight_take_turns_and_the_first_stage_gets_every_token():
    config = EngineConfig(pipeline_parallel_size=2)
    scheduler = Scheduler(block_manager=BlockManager(64, 4, True), max_num_seqs=16, max_num_batched_tokens=64,
                          max_model_len=128)
    scheduler.micro_batches = micro_batches_for(config, "cuda")
    assert isinstance(scheduler.micro_batches, MicroBatches)
    assert steps_in_flight(config, scheduler.micro_batches) == 2
    for request_id, prompt in PROMPTS.items():
        scheduler.add_request(EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt,
                                                sampling=SamplingOptions(max_tokens=MAX_TOKENS)))
    first, last = FirstStage(), LastStage()
    in_flight: deque[tuple[SchedulerOutput, dict[str, list[int]]]] = deque()
    outputs: dict[str, list[int]] = {request_id: [] for request_id in PROMPTS}
    both_busy = 0
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        while len(in_flight) < 2:
            out = scheduler.schedule()
            if out.is_empty:
                break
            # (No prompt here is chunked: every scheduled request samples.)
            in_flight_ids = {request_id for step, _ in in_flight for request_id in step.num_scheduled_tokens}
            assert not in_flight_ids & set(out.num_scheduled_tokens), "a request is in two steps in flight"
            in_flight.append((out, first.run(out)))
        both_busy += len(in_flight) == 2
        out, inputs = in_flight.popleft()
        for output in scheduler.update_from_output(out, last.run(out, inputs)).outputs:
            outputs[output.request_id].extend(output.new_token_ids)
    assert not scheduler.has_unfinished_requests()
    assert outputs == {rid: [sampled(rid, i) for i in range(MAX_TOKENS)] for rid in PROMPTS}
    assert both_busy >= MAX_TOKENS, both_busy  # the six requests decode in two groups taking turns


def test_when_there_are_micro_batches(monkeypatch):
    import pytest

    from asyncengine.errors import ConfigError

    pp2, pp4 = EngineConfig(pipeline_parallel_size=2), EngineConfig(pipeline_parallel_size=4)
    monkeypatch.delenv(MICRO_BATCHES_ENV, raising=False)
    assert micro_batches_for(EngineConfig(), "cuda") is None  # no stages
    assert micro_batches_for(EngineConfig(pipeline_parallel_size=2, async_scheduling=False), "cuda") is None
    assert micro_batches_for(pp2, "cpu") is not None  # on by default, on CPU too (measured: they pay there)
    assert steps_in_flight(pp4, micro_batches_for(pp4, "cuda")) == 4
    assert steps_in_flight(pp4, None) == 2 and steps_in_flight(EngineConfig(async_scheduling=False), None) == 1
    monkeypatch.setenv(MICRO_BATCHES_ENV, "1")
    assert micro_batches_for(pp2, "cpu") is not None
    monkeypatch.setenv(MICRO_BATCHES_ENV, "0")
    assert micro_batches_for(pp2, "cuda") is None and micro_batches_for(pp2, "cpu") is None
    monkeypatch.setenv(MICRO_BATCHES_ENV, "yes")
    with pytest.raises(ConfigError, match="ASYNCENGINE_PIPELINE_MICRO_BATCHES='yes'"):
        micro_batches_for(pp2, "cuda")
