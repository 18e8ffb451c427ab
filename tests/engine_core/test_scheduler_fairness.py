"""Fairness between requests in the Scheduler: the sequences of one request (sharing a `parent_id`) never
hold more than half of the sequence slots at once, alone or not, and take at most half of a step's token
budget while any other request waits (all of it when nobody else does): docs/server.md, "Fairness".

Driven in-process with a stand-in for the worker that samples one token for every sequence whose
scheduled tokens reach its end, as the model runner does.
"""

from __future__ import annotations

from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.scheduler import Scheduler
from asyncengine.wire.engine_core import EngineCoreRequest, SamplingOptions
from asyncengine.wire.worker import ModelRunnerOutput, SchedulerOutput

MAX_NUM_SEQS = 8
BUDGET = 64
SAMPLED = 900  # the token every sequence samples: no stop token, so requests end by length


def scheduler(**changes) -> Scheduler:
    options = dict(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=BUDGET, max_model_len=256)
    options.update(changes)
    return Scheduler(block_manager=BlockManager(4096, 4, True), **options)


def request(request_id: str, prompt_len: int, max_tokens: int, parent_id: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=[10 + i % 50 for i in range(prompt_len)],
                             sampling=SamplingOptions(max_tokens=max_tokens), parent_id=parent_id)


def add_parent(sched: Scheduler, name: str, n: int, *, prompt_len: int = 6, max_tokens: int = 40) -> list[str]:
    ids = [f"{name}#{i}" for i in range(n)]
    for child in ids:
        sched.add_request(request(child, prompt_len, max_tokens, parent_id=name))
    return ids


def run_step(sched: Scheduler, progress: dict[str, int]) -> tuple[SchedulerOutput, list[str]]:
    """One synchronous step; returns the schedule and the requests that finished in it."""
    out = sched.schedule()
    sampled = []
    for request_id, num_tokens in out.num_scheduled_tokens.items():
        seq = sched.sequences[request_id]
        if seq.num_pending_tokens:  # steps run one at a time: a token in flight is this step's sample
            sampled.append(request_id)
        progress[request_id] = progress.get(request_id, 0) + num_tokens
    outputs = sched.update_from_output(out, ModelRunnerOutput(request_ids=sampled,
                                                              sampled_token_ids=[SAMPLED] * len(sampled)))
    return out, [o.request_id for o in outputs.outputs if o.finished]


def test_a_request_at_max_n_gets_at_most_half_of_the_slots_and_budget_while_others_wait():
    sched = scheduler()
    children = set(add_parent(sched, "big", 128, max_tokens=10))
    others = [f"small-{i}" for i in range(6)]
    for other in others:
        sched.add_request(request(other, 5, 8))
    finished_at: dict[str, int] = {}
    progress: dict[str, int] = {}
    contended_steps = 0
    for step in range(1000):
        if not sched.has_unfinished_requests():
            break
        others_waiting = any(seq.request_id not in children for seq in sched.waiting)
        out, finished = run_step(sched, progress)
        for request_id in finished:
            finished_at[request_id] = step
        if others_waiting:
            contended_steps += 1
            big_tokens = sum(n for rid, n in out.num_scheduled_tokens.items() if rid in children)
            big_running = sum(1 for seq in sched.running if seq.request_id in children)
            # The stated share: half of the budget, half of the slots.
            assert big_tokens <= BUDGET // 2, (step, big_tokens)
            assert big_running <= MAX_NUM_SEQS // 2, (step, big_running)
    assert not sched.has_unfinished_requests()
    assert contended_steps > 0
    # The small requests (8 tokens each) share the other half of the slots: two rounds of about 8 steps,
    # long before the 128 completions of 10 tokens are done (over 150 steps on 8 slots).
    assert max(finished_at[o] for o in others) < 30, finished_at
    assert max(finished_at[c] for c in children) > 150


def test_alone_a_request_with_many_completions_holds_half_the_slots_and_a_later_one_starts_next_step():
    sched = scheduler()
    children = set(add_parent(sched, "big", 32))
    progress: dict[str, int] = {}
    run_step(sched, progress)
    # Nobody else waits, yet the request holds only its share: the other half stays free, so a request
    # that arrives now runs at the very next step, long before the big one is done.
    assert len(sched.running) == MAX_NUM_SEQS // 2
    sched.add_request(request("late", 5, 4))
    out, _ = run_step(sched, progress)
    assert "late" in out.num_scheduled_tokens
    finished: set[str] = set()
    while sched.has_unfinished_requests():
        finished.update(run_step(sched, progress)[1])
        assert sum(1 for seq in sched.running if seq.request_id in children) <= MAX_NUM_SEQS // 2
    assert finished >= children  # every completion ran, its share at a time


def test_a_prompt_alone_in_its_group_and_requests_without_one_are_not_held_back():
    sched = scheduler()
    for index in range(MAX_NUM_SEQS):
        sched.add_request(request(f"single-{index}", 5, 4))
    run_step(sched, {})
    assert len(sched.running) == MAX_NUM_SEQS  # requests of their own (no parent) fill every slot


def test_a_parent_over_its_share_keeps_its_place_and_later_requests_pass_it():
    sched = scheduler(max_num_seqs=4)
    add_parent(sched, "big", 10)
    sched.add_request(request("after", 5, 4))
    progress: dict[str, int] = {}
    out, _ = run_step(sched, progress)
    admitted = [new.request_id for new in out.new_requests]
    # Two of the big request's completions (half of 4 slots), then the later request, in the same step.
    assert admitted == ["big#0", "big#1", "after"]
    # The deferred completions are still first in line, in order.
    assert [seq.request_id for seq in sched.waiting][:3] == ["big#2", "big#3", "big#4"]


def test_token_budget_share_holds_for_long_prompts_with_chunked_prefill():
    sched = scheduler(max_num_batched_tokens=32)
    children = set(add_parent(sched, "big", 8, prompt_len=60, max_tokens=4))
    sched.add_request(request("other", 60, 4))
    progress: dict[str, int] = {}
    while any(seq.request_id not in children for seq in sched.waiting) or "other" in sched.sequences:
        others_waiting = any(seq.request_id not in children for seq in sched.waiting)
        out, _ = run_step(sched, progress)
        if others_waiting:
            assert sum(n for rid, n in out.num_scheduled_tokens.items() if rid in children) <= 16
    assert "other" not in sched.sequences
