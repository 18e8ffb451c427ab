"""The Scheduler's priority policy (vLLM's --scheduling-policy priority; docs/server.md, "Priority"): a lower
`priority` value is admitted first, ties by arrival; under memory pressure the running sequence with the
highest value and the latest arrival is preempted first, and it resumes in its place by (priority, arrival);
the per-request share of the slots still holds. The prefix cache's `cache_salt`: different salts share no
blocks, the same salt does.

Driven in-process with a stand-in for the worker that samples one token for every sequence whose scheduled
tokens reach their end, as the model runner does.
"""

from __future__ import annotations

from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.scheduler import Scheduler
from asyncengine.wire.engine_core import EngineCoreRequest, SamplingOptions
from asyncengine.wire.worker import ModelRunnerOutput

SAMPLED = 900  # every sequence samples it: no stop token, requests end by length


def scheduler(*, num_blocks: int = 256, max_num_seqs: int = 8, policy: str = "priority") -> Scheduler:
    sched = Scheduler(block_manager=BlockManager(num_blocks, 4, True), max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=64, max_model_len=256)
    sched.policy = policy
    return sched


def request(request_id: str, prompt: list[int], *, priority: int = 0, max_tokens: int = 4,
            parent_id: str | None = None, cache_salt: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling=SamplingOptions(
        max_tokens=max_tokens), priority=priority, parent_id=parent_id, cache_salt=cache_salt)


def step(sched: Scheduler) -> tuple[list[str], list[str], list[str]]:
    """One synchronous step: (sequences admitted, preempted, finished) in it."""
    out = sched.schedule()
    preempted = [rid for rid in out.finished_request_ids if rid in sched.sequences]
    # steps run one at a time: a token in flight is this step's sample
    sampled = [rid for rid in out.num_scheduled_tokens if sched.sequences[rid].num_pending_tokens]
    result = sched.update_from_output(out, ModelRunnerOutput(request_ids=sampled,
                                                             sampled_token_ids=[SAMPLED] * len(sampled)))
    return ([new.request_id for new in out.new_requests], preempted,
            [o.request_id for o in result.outputs if o.finished])


def prompt(start: int, length: int = 4) -> list[int]:
    return list(range(start, start + length))


def test_the_lowest_value_is_admitted_first_and_ties_go_by_arrival() -> None:
    sched = scheduler(max_num_seqs=1)
    for rid, priority in [("late-5", 5), ("first-1", 1), ("zero", 0), ("second-1", 1), ("minus", -3)]:
        sched.add_request(request(rid, prompt(10 * len(sched.sequences)), priority=priority, max_tokens=2))
    order = []
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        order += step(sched)[0]
    assert order == ["minus", "zero", "first-1", "second-1", "late-5"]


def test_fcfs_ignores_priority() -> None:
    sched = scheduler(max_num_seqs=1, policy="fcfs")
    for index, priority in enumerate([5, 1, 0]):
        sched.add_request(request(f"r{index}", prompt(10 * index), priority=priority, max_tokens=2))
    order = []
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        order += step(sched)[0]
    assert order == ["r0", "r1", "r2"]


def test_under_memory_pressure_the_highest_value_latest_arrival_is_preempted_and_resumes_in_its_place() -> None:
    # 6 blocks of 4 tokens: three 8-token prompts fill them; the first decode step needs a third block each.
    sched = scheduler(num_blocks=6)
    # urgent arrives last (fcfs would preempt it first, as the latest admitted).
    sched.add_request(request("lazy-early", prompt(100, 8), priority=9, max_tokens=6))
    sched.add_request(request("lazy-late", prompt(200, 8), priority=9, max_tokens=6))
    sched.add_request(request("urgent", prompt(0, 8), priority=0, max_tokens=6))
    admitted, preempted, _ = step(sched)
    assert admitted == ["urgent", "lazy-early", "lazy-late"]
    _, preempted, _ = step(sched)
    # urgent needs a block: lazy-late (highest value, latest arrival) goes first, then lazy-early.
    assert preempted[:1] == ["lazy-late"]
    assert "urgent" not in preempted and sched.sequences["urgent"] in sched.running
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        assert "urgent" not in step(sched)[1]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_a_preempted_sequence_waits_ahead_of_later_and_lesser_ones() -> None:
    sched = scheduler(num_blocks=4, max_num_seqs=2)
    sched.add_request(request("a", prompt(0, 8), priority=1, max_tokens=8))
    sched.add_request(request("b", prompt(100, 8), priority=2, max_tokens=8))
    step(sched)
    sched.add_request(request("c", prompt(200, 4), priority=3, max_tokens=2))
    sched.add_request(request("d", prompt(300, 4), priority=0, max_tokens=2))
    _, preempted, _ = step(sched)
    assert preempted == ["b"]
    # d (0) before the preempted b (2) before c (3): the queue stays in (priority, arrival) order.
    assert [seq.request_id for seq in sched.waiting] == ["d", "b", "c"]


def test_the_share_of_the_slots_still_holds_for_an_urgent_fan_out() -> None:
    sched = scheduler(max_num_seqs=4)
    for index in range(4):  # one request with n=4, most urgent: at most half of the slots
        sched.add_request(request(f"fan#{index}", prompt(10 * index), priority=-10, parent_id="fan", max_tokens=20))
    sched.add_request(request("other", prompt(100), priority=10, max_tokens=2))
    admitted, _, _ = step(sched)
    assert admitted == ["fan#0", "fan#1", "other"]


def test_a_cache_salt_keeps_prefixes_apart() -> None:
    sched = scheduler()
    shared = prompt(0, 12)
    sched.add_request(request("a", shared + [50], cache_salt="alice"))
    step(sched)
    for rid, salt in [("same", "alice"), ("other", "bob"), ("none", None)]:
        sched.add_request(request(rid, shared + [60], cache_salt=salt))
    step(sched)
    hits = {rid: sched.sequences[rid].num_cached_tokens for rid in ("same", "other", "none")}
    assert hits == {"same": 12, "other": 0, "none": 0}
    assert sched.sequences["same"].block_ids[:3] == sched.sequences["a"].block_ids[:3]
