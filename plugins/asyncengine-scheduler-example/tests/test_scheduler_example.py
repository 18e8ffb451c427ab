"""RecordingScheduler: schedules exactly as Scheduler does, records where it runs, passes the hook's check.

The end-to-end test (a real engine, the class in the engine-core process, async scheduling kept) is
tests/e2e/test_config_hooks_e2e.py in the asyncengine repository.
"""

from __future__ import annotations

import json

import msgspec
import pytest

import ae_scheduler_example
from ae_scheduler_example import RecordingScheduler
from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.scheduler import Scheduler
from asyncengine.wire.engine_core import EngineCoreRequest, SamplingOptions
from asyncengine.wire.worker import ModelRunnerOutput

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16]]


@pytest.fixture(autouse=True)
def engine_core_role(monkeypatch):
    # No engine runs in this test process, so it has no role; the plugin asks through plugins_api.
    monkeypatch.setattr(ae_scheduler_example, "current_process_role", lambda: "engine core")


def drive(cls: type[Scheduler]) -> tuple[Scheduler, list, list]:
    """Run three requests to completion, one step at a time, every scheduled request sampling a token."""
    scheduler = cls(block_manager=BlockManager(64, 4, True), max_num_seqs=2, max_num_batched_tokens=8,
                    max_model_len=64)
    for index, prompt in enumerate(PROMPTS):
        scheduler.add_request(EngineCoreRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                                                sampling=SamplingOptions(temperature=0.0, max_tokens=3 + index)))
    steps, finished = [], []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        steps.append(msgspec.to_builtins(output))
        sampling = [request_id for request_id in output.num_scheduled_tokens
                    if scheduler.sequences[request_id].num_pending_tokens]
        result = scheduler.update_from_output(
            output, ModelRunnerOutput(request_ids=sampling, sampled_token_ids=[100 + len(steps)] * len(sampling)))
        finished += [(o.request_id, o.finish_reason) for o in result.outputs if o.finished]
        assert len(steps) < 100, "the scheduler made no progress"
    return scheduler, steps, finished


def test_it_schedules_exactly_as_the_builtin_scheduler(tmp_path, monkeypatch):
    monkeypatch.setenv("AE_PLUGIN_RECORD", str(tmp_path / "record.jsonl"))
    recording, steps, finished = drive(RecordingScheduler)
    _, reference_steps, reference_finished = drive(Scheduler)
    assert steps == reference_steps
    assert finished == reference_finished and len(finished) == len(PROMPTS)
    assert recording.num_schedule_calls == len(steps)
    assert recording.num_scheduled_tokens == sum(sum(step["num_scheduled_tokens"].values()) for step in steps)


def test_it_records_its_process_and_role(tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("AE_PLUGIN_RECORD", str(record))
    drive(RecordingScheduler)
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [line["event"] for line in lines] == ["init", "first schedule"]
    assert all(line["role"] == "engine core" and line["plugin"] == "ae_scheduler_example" for line in lines)
    assert lines[0]["cls"] == "ae_scheduler_example:RecordingScheduler"


def test_without_the_variable_it_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("AE_PLUGIN_RECORD", raising=False)
    monkeypatch.chdir(tmp_path)
    drive(RecordingScheduler)
    assert list(tmp_path.iterdir()) == []


def test_the_scheduler_cls_hook_accepts_it():
    from asyncengine.plugin_runtime.config_hooks import load_hook

    assert load_hook("scheduler_cls", "ae_scheduler_example:RecordingScheduler") is RecordingScheduler
