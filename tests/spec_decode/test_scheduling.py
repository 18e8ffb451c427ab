"""The scheduler's side of speculative decoding, driven by hand (no worker): a request's drafts are scheduled
beside its last token, cut to the budget, max_tokens and max_model_len; the rejected positions are rolled back
and the blocks only they needed released, the next step telling the worker how much of its table to keep; the
counters follow; every block is free at the end."""

from __future__ import annotations

from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.scheduler import Scheduler
from asyncengine.wire.engine_core import EngineCoreRequest, SamplingOptions
from asyncengine.wire.worker import ModelRunnerOutput


def make(num_speculative_tokens: int = 3, *, budget: int = 32, max_model_len: int = 64) -> Scheduler:
    scheduler = Scheduler(block_manager=BlockManager(16, 2, True), max_num_seqs=4, max_num_batched_tokens=budget,
                          max_model_len=max_model_len)
    scheduler.enable_speculation(num_speculative_tokens)
    return scheduler


def sampled(request_id: str, token: int, accepted: list[int], drafts: list[int]) -> ModelRunnerOutput:
    return ModelRunnerOutput(request_ids=[request_id], sampled_token_ids=[token], accepted_token_ids=[accepted],
                             draft_token_ids=[drafts])


def test_drafts_are_verified_and_the_rejected_rolled_back():
    scheduler = make()
    manager = scheduler.block_manager
    scheduler.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=[1, 2, 3],
                                            sampling=SamplingOptions(max_tokens=20)))
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"a": 3} and step.spec_token_ids is None
    scheduler.update_from_output(step, sampled("a", 4, [], [5, 6, 7]))
    seq = scheduler.sequences["a"]

    step = scheduler.schedule()  # its last token (position 3) and three drafts (positions 4-6)
    assert step.num_scheduled_tokens == {"a": 4} and step.spec_token_ids == {"a": [5, 6, 7]}
    assert seq.num_computed_tokens == 7 and len(seq.block_ids) == 4
    outputs = scheduler.update_from_output(step, sampled("a", 9, [5], [9, 9]))  # 5 kept, 6 rejected: 9 instead
    assert outputs.outputs[0].new_token_ids == [5, 9]
    assert seq.token_ids == [1, 2, 3, 4, 5, 9]
    # Positions 0-4 hold the request's tokens; 5 (the new 9) is computed next: 3 blocks of 2 kept, 1 released.
    assert seq.num_computed_tokens == 5 and len(seq.block_ids) == 3
    assert manager.num_free_blocks == manager.num_usable_blocks - 3

    step = scheduler.schedule()
    assert step.spec_token_ids == {"a": [9, 9]}
    (cached,) = step.cached_requests
    assert cached.block_table_lengths == [3]  # the worker drops the released block before appending
    scheduler.update_from_output(step, sampled("a", 10, [9, 9], []))  # all accepted, and the bonus token
    assert seq.token_ids[-3:] == [9, 9, 10] and seq.num_computed_tokens == 8

    stats = scheduler.make_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens,
            stats.spec_decode_num_accepted_tokens_per_pos) == (2, 5, 3, [2, 1, 0])
    scheduler.finish_requests("a")
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_drafts_are_cut_to_max_tokens_max_model_len_and_the_budget():
    for limits, expected in ((dict(max_tokens=3), [5]),  # 1 emitted, 2 left: one draft and the target's token
                             (dict(max_model_len=7), [5, 6]),  # 4 tokens, room for 3 more
                             (dict(budget=3), [5, 6])):  # the step's budget: its last token and 2 drafts
        scheduler = make(4, budget=limits.get("budget", 32), max_model_len=limits.get("max_model_len", 64))
        scheduler.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=[1, 2, 3],
                                                sampling=SamplingOptions(max_tokens=limits.get("max_tokens", 20))))
        scheduler.update_from_output(scheduler.schedule(), sampled("a", 4, [], [5, 6, 7, 8]))
        step = scheduler.schedule()
        assert step.spec_token_ids == {"a": expected}, limits
        assert step.num_scheduled_tokens == {"a": 1 + len(expected)}


def test_a_stop_token_among_the_accepted_ends_the_request_there():
    scheduler = make()
    scheduler.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=[1, 2, 3],
                                            sampling=SamplingOptions(max_tokens=20, stop_token_ids=[6])))
    scheduler.update_from_output(scheduler.schedule(), sampled("a", 4, [], [5, 6, 7]))
    step = scheduler.schedule()
    outputs = scheduler.update_from_output(step, sampled("a", 8, [5, 6, 7], []))
    (output,) = outputs.outputs
    assert output.new_token_ids == [5, 6] and output.finish_reason == "stop" and output.stop_reason == 6
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_usable_blocks
