"""Scheduler: budgets, chunked prefill, preemption, prefix reuse, stops, aborts and block leaks.

The scheduler is driven by `FakeWorker`, which plays the model runner's part without a model: it keeps each
request's tokens, block table and progress from the NewRequestData / CachedRequestData it is sent (as
`ModelRunner._update_states` does), "samples" a chosen token for each request whose scheduled tokens reach
the end of its tokens, and simulates the KV cache slot by slot, so that every step also checks that each
request attends only to its own earlier tokens (which is what prefix reuse and preemption must preserve).

`Harness.step` checks the scheduler's invariants around every step (budgets, batch order, preemption
order, block reference counts, the worker's view matching the scheduler's).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Iterable

import pytest

from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.scheduler import Scheduler
from asyncengine.engine_core.sequence import Sequence, SequenceStatus
from asyncengine.wire.engine_core import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SamplingOptions
from asyncengine.wire.worker import ModelRunnerOutput, SchedulerOutput

# The token a request samples, given its id and how many output tokens it has so far.
Sampler = Callable[[str, int], int]


def default_sampler(request_id: str, index: int) -> int:
    return 100_000 + index  # far from any prompt token or stop token used below


def scripted(scripts: dict[str, list[int]], fallback: Sampler = default_sampler) -> Sampler:
    def sample(request_id: str, index: int) -> int:
        script = scripts.get(request_id, [])
        return script[index] if index < len(script) else fallback(request_id, index)

    return sample


class _WorkerRequest:
    def __init__(self, token_ids: list[int], num_prompt_tokens: int, block_ids: list[int], num_computed: int) -> None:
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.block_ids = block_ids
        self.num_computed_tokens = num_computed


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, sampler: Sampler) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sampler = sampler
        self.requests: dict[str, _WorkerRequest] = {}
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token id) stored there
        self.sampled: dict[str, list[int]] = defaultdict(list)  # every token ever sampled, per request

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            assert request_id in self.requests, f"told to forget {request_id!r}, which it never knew"
            del self.requests[request_id]
        for new in scheduler_output.new_requests:
            assert new.request_id not in self.requests, f"{new.request_id!r} sent as new twice"
            # A resumed request comes back with exactly the outputs it had sampled before.
            assert list(new.output_token_ids) == self.sampled[new.request_id]
            self.requests[new.request_id] = _WorkerRequest(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                len(new.prompt_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
            )
        for cached in scheduler_output.cached_requests:
            state = self.requests[cached.request_id]
            assert cached.num_computed_tokens == state.num_computed_tokens
            state.block_ids.extend(cached.new_block_ids)

        spans = {}
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[request_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
            assert num_tokens >= 1
            assert end <= len(state.token_ids), f"{request_id}: scheduled past its last token"
            assert len(state.block_ids) * self.block_size >= end, f"{request_id}: too few blocks"
            assert all(0 <= b < self.num_blocks for b in state.block_ids)
            spans[request_id] = (start, end)
        # One forward pass: every request's new keys and values are stored, then attention reads them.
        for request_id, (start, end) in spans.items():
            state = self.requests[request_id]
            for position in range(start, end):
                self.kv[self._slot(state, position)] = (position, state.token_ids[position])
        for request_id, (_, end) in spans.items():
            state = self.requests[request_id]
            for position in range(end):
                stored = self.kv.get(self._slot(state, position))
                assert stored == (position, state.token_ids[position]), (
                    f"{request_id} reads a wrong KV entry at position {position}: {stored}"
                )

        output = ModelRunnerOutput()
        for request_id, (_, end) in spans.items():
            state = self.requests[request_id]
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                token = self.sampler(request_id, len(state.token_ids) - state.num_prompt_tokens)
                state.token_ids.append(token)
                self.sampled[request_id].append(token)
                output.request_ids.append(request_id)
                output.sampled_token_ids.append(token)
        return output

    def _slot(self, state: _WorkerRequest, position: int) -> int:
        return state.block_ids[position // self.block_size] * self.block_size + position % self.block_size


def make_request(request_id: str, prompt: list[int], **sampling) -> EngineCoreRequest:
    sampling.setdefault("max_tokens", 4)
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=list(prompt), sampling=SamplingOptions(**sampling))


class Harness:
    def __init__(
        self,
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 64,
        max_model_len: int = 128,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        sampler: Sampler = default_sampler,
    ) -> None:
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            block_manager=self.manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
        )
        self.worker = FakeWorker(num_blocks, block_size, sampler)
        self.outputs: dict[str, list[EngineCoreOutput]] = defaultdict(list)
        self.finished: dict[str, EngineCoreOutput] = {}
        self.preempted_log: list[list[str]] = []  # per step, the requests preempted, in preemption order
        self.aborted_while: dict[str, SequenceStatus] = {}  # aborted request -> its status when aborted
        self.num_steps = 0

    # -- requests --------------------------------------------------------------------------------------

    def add(self, request_id: str, prompt: list[int], **sampling) -> None:
        self.scheduler.add_request(make_request(request_id, prompt, **sampling))

    def seq(self, request_id: str) -> Sequence:
        return self.scheduler.sequences[request_id]

    def output_tokens(self, request_id: str) -> list[int]:
        return [t for out in self.outputs[request_id] for t in out.new_token_ids]

    # -- stepping --------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        scheduler = self.scheduler
        running_before = [s.request_id for s in scheduler.running]
        computed_before = {rid: s.num_computed_tokens for rid, s in scheduler.sequences.items()}
        tokens_before = {rid: s.num_tokens for rid, s in scheduler.sequences.items()}

        out = scheduler.schedule()
        self.num_steps += 1

        scheduled = out.num_scheduled_tokens
        assert out.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        assert len(scheduled) <= scheduler.max_num_seqs
        assert all(n >= 1 for n in scheduled.values())

        # Preempted this step: known before, still unfinished, no longer running.
        preempted = [
            rid
            for rid in out.finished_request_ids
            if rid in scheduler.sequences and scheduler.sequences[rid].status is SequenceStatus.PREEMPTED
        ]
        self.preempted_log.append(preempted)
        if preempted:
            # Most recently admitted first, and they wait at the front, in their admission order.
            k = len(preempted)
            assert preempted == running_before[::-1][:k]
            assert [s.request_id for s in list(scheduler.waiting)[:k]] == running_before[-k:]
            assert not out.new_requests, "admitted a waiting request in a step that had to preempt"
            for rid in preempted:
                seq = scheduler.sequences[rid]
                assert seq.block_ids == [] and seq.num_computed_tokens == 0
                assert rid not in scheduled
        survivors = [rid for rid in running_before if rid not in preempted]
        admitted = [new.request_id for new in out.new_requests]
        assert [s.request_id for s in scheduler.running] == survivors + admitted
        # Batch order: running requests first (in running order), then the admitted ones.
        assert list(scheduled) == [c.request_id for c in out.cached_requests] + admitted
        assert [c.request_id for c in out.cached_requests] == survivors[: len(out.cached_requests)]
        for rid, num in scheduled.items():
            seq = scheduler.sequences[rid]
            assert seq.num_computed_tokens <= seq.num_tokens
            if rid in running_before:
                assert seq.num_computed_tokens == computed_before[rid] + num
                if computed_before[rid] == tokens_before[rid] - 1:
                    assert num == 1  # decoding: one token each
            if not scheduler.enable_chunked_prefill:
                assert seq.num_computed_tokens == seq.num_tokens, "a prompt was split without chunked prefill"
        self.check_blocks()
        return out

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        runner_output = self.worker.execute(out)
        running = {s.request_id: s for s in self.scheduler.running}
        assert set(self.worker.requests) == set(running)
        for rid, seq in running.items():
            assert self.worker.requests[rid].block_ids == seq.block_ids
            assert self.worker.requests[rid].num_computed_tokens == seq.num_computed_tokens
        return runner_output

    def update(
        self, out: SchedulerOutput, runner_output: ModelRunnerOutput, aborted: Iterable[str] = ()
    ) -> EngineCoreOutputs:
        result = self.scheduler.update_from_output(out, runner_output)
        aborted = set(aborted)
        # One output per sampled request, in batch order, except for requests aborted while the step ran.
        assert [o.request_id for o in result.outputs] == [r for r in runner_output.request_ids if r not in aborted]
        sampled = dict(zip(runner_output.request_ids, runner_output.sampled_token_ids))
        for output in result.outputs:
            assert output.request_id not in self.finished, f"{output.request_id} got output after finishing"
            assert output.new_token_ids == [sampled[output.request_id]]
            self.outputs[output.request_id].append(output)
            if output.finished:
                self.finished[output.request_id] = output
                assert output.request_id not in self.scheduler.sequences
        self.check_blocks()
        return result

    def step(self, abort_in_flight: Iterable[str] = ()) -> tuple[SchedulerOutput, EngineCoreOutputs]:
        out = self.schedule()
        runner_output = self.execute(out)
        aborted = self.abort(abort_in_flight)
        return out, self.update(out, runner_output, aborted)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        request_ids = list(request_ids)
        statuses = {rid: seq.status for rid, seq in self.scheduler.sequences.items()}
        aborted = self.scheduler.finish_requests(request_ids)
        for rid in aborted:
            self.finished[rid] = EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="abort")
            self.aborted_while[rid] = statuses[rid]
        self.check_blocks()
        return aborted

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps: {self.scheduler.sequences}")

    def check_blocks(self) -> None:
        """Every block's reference count is the number of live sequences holding it; free means unreferenced."""
        holders = defaultdict(int)
        for seq in self.scheduler.sequences.values():
            if seq.status is not SequenceStatus.RUNNING:
                assert seq.block_ids == [], f"{seq} holds blocks while not running"
            for block_id in seq.block_ids:
                holders[block_id] += 1
        for block in self.manager.blocks:
            assert block.ref_count == holders[block.block_id], f"block {block.block_id}"
        assert self.manager.num_free_blocks == sum(1 for b in self.manager.blocks if b.ref_count == 0)

    def assert_no_leaks(self) -> None:
        assert not self.scheduler.has_unfinished_requests()
        assert not self.scheduler.running and not self.scheduler.waiting
        assert self.manager.num_free_blocks == self.manager.num_blocks
        assert all(block.ref_count == 0 for block in self.manager.blocks)
        assert self.manager.usage == 0.0


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def test_duplicate_request_id_is_rejected_while_the_first_is_unfinished() -> None:
    h = Harness()
    h.add("a", prompt(0, 3), max_tokens=1)
    with pytest.raises(ValueError, match="already in the scheduler"):
        h.add("a", prompt(10, 3))
    h.run()
    assert h.scheduler.get_num_unfinished_requests() == 0
    out = h.scheduler.schedule()
    assert out.is_empty and out.finished_request_ids == ["a"]  # an empty step still tells the worker


# -- budgets -------------------------------------------------------------------------------------------


def test_prefill_then_one_token_per_decode() -> None:
    h = Harness()
    h.add("a", prompt(0, 5))
    h.add("b", prompt(100, 6))
    h.add("c", prompt(200, 7))

    out, result = h.step()
    assert out.num_scheduled_tokens == {"a": 5, "b": 6, "c": 7}
    assert [n.request_id for n in out.new_requests] == ["a", "b", "c"]
    assert [n.num_computed_tokens for n in out.new_requests] == [0, 0, 0]
    assert [o.request_id for o in result.outputs] == ["a", "b", "c"]
    assert result.num_scheduled_tokens == 18

    out, result = h.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    assert out.new_requests == []
    assert [(c.request_id, c.num_computed_tokens) for c in out.cached_requests] == [("a", 5), ("b", 6), ("c", 7)]
    assert result.num_scheduled_tokens == 3


def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_chunks() -> None:
    h = Harness(max_num_batched_tokens=10)
    h.add("long", prompt(0, 23))
    h.add("short", prompt(100, 5))

    steps = [h.step() for _ in range(4)]
    assert [out.num_scheduled_tokens for out, _ in steps] == [
        {"long": 10},
        {"long": 10},
        {"long": 3, "short": 5},  # short waits until the budget has room
        {"long": 1, "short": 1},
    ]
    # Only the step that reaches the end of the prompt samples.
    assert [[o.request_id for o in result.outputs] for _, result in steps] == [
        [],
        [],
        ["long", "short"],
        ["long", "short"],
    ]
    assert [c.num_computed_tokens for c in steps[1][0].cached_requests] == [10]
    assert [c.num_computed_tokens for c in steps[2][0].cached_requests] == [20]


def test_chunked_prefill_admits_a_partial_chunk_with_the_rest_of_the_budget() -> None:
    h = Harness(max_num_batched_tokens=10)
    h.add("a", prompt(0, 4))
    h.add("b", prompt(100, 20))

    steps = [h.step()[0].num_scheduled_tokens for _ in range(4)]
    assert steps == [
        {"a": 4, "b": 6},
        {"a": 1, "b": 9},
        {"a": 1, "b": 5},  # b's prompt ends here: b samples
        {"a": 1, "b": 1},
    ]
    assert len(h.output_tokens("b")) == 2


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room() -> None:
    h = Harness(max_num_batched_tokens=10, enable_chunked_prefill=False)
    h.add("a", prompt(0, 4))
    h.add("b", prompt(100, 8))

    first, _ = h.step()
    assert first.num_scheduled_tokens == {"a": 4}  # b (8) does not fit in the 6 left
    assert [s.request_id for s in h.scheduler.waiting] == ["b"]
    assert h.seq("b").num_computed_tokens == 0 and h.seq("b").block_ids == []

    second, _ = h.step()
    assert second.num_scheduled_tokens == {"a": 1, "b": 8}


def test_max_num_seqs_caps_the_running_batch() -> None:
    h = Harness(max_num_seqs=2)
    for i, rid in enumerate("abcd"):
        h.add(rid, prompt(100 * i, 3), max_tokens=2 if rid in "ab" else 3)

    first, _ = h.step()
    assert list(first.num_scheduled_tokens) == ["a", "b"]
    second, _ = h.step()  # a and b sample their 2nd token and finish
    assert list(second.num_scheduled_tokens) == ["a", "b"]
    assert set(h.finished) == {"a", "b"}
    third, _ = h.step()
    assert third.num_scheduled_tokens == {"c": 3, "d": 3}
    assert third.finished_request_ids == ["a", "b"]
    h.run()
    assert [len(h.output_tokens(r)) for r in "abcd"] == [2, 2, 3, 3]


@pytest.mark.parametrize("chunked", [True, False])
def test_budgets_hold_under_a_heavy_mixed_load(chunked: bool) -> None:
    rng = random.Random(1234)
    h = Harness(max_num_seqs=5, max_num_batched_tokens=24, num_blocks=256, enable_chunked_prefill=chunked)
    max_tokens = {f"r{i}": rng.randint(1, 12) for i in range(40)}
    for i, (rid, n) in enumerate(max_tokens.items()):
        h.add(rid, prompt(1000 * i, rng.randint(1, 24)), max_tokens=n)
    batch_sizes = []
    while h.scheduler.has_unfinished_requests():  # Harness.schedule checks both budgets at every step
        out, _ = h.step()
        batch_sizes.append((len(out.num_scheduled_tokens), out.total_num_scheduled_tokens))
    assert max(n for n, _ in batch_sizes) == 5  # the caps were reached, not just respected
    assert max(t for _, t in batch_sizes) == 24
    assert not any(h.preempted_log)
    assert {rid: len(h.output_tokens(rid)) for rid in max_tokens} == max_tokens
    assert all(h.finished[rid].finish_reason == "length" for rid in max_tokens)
    h.assert_no_leaks()


# -- preemption ----------------------------------------------------------------------------------------


def test_preemption_frees_the_most_recently_admitted_first_and_they_resume() -> None:
    # 4 blocks of 4 tokens; four 4-token prompts fill the cache exactly. Each decode then needs a second block.
    h = Harness(num_blocks=4, block_size=4)
    for i, rid in enumerate("abcd"):
        h.add(rid, prompt(100 * i, 4), max_tokens=3 if rid in "ab" else 4)

    first, _ = h.step()
    assert first.num_scheduled_tokens == {"a": 4, "b": 4, "c": 4, "d": 4}
    assert h.manager.num_free_blocks == 0

    # a needs a block: d (admitted last) is preempted; then b needs one: c is preempted.
    second, _ = h.step()
    assert second.num_scheduled_tokens == {"a": 1, "b": 1}
    assert h.preempted_log[-1] == ["d", "c"]
    assert second.finished_request_ids == ["d", "c"]  # the worker forgets them in this very step
    assert [s.request_id for s in h.scheduler.waiting] == ["c", "d"]
    for rid in "cd":
        seq = h.seq(rid)
        assert seq.status is SequenceStatus.PREEMPTED
        assert seq.block_ids == [] and seq.num_computed_tokens == 0 and seq.num_preemptions == 1
        assert seq.output_token_ids == [default_sampler(rid, 0)]  # the token sampled before is kept
    assert [len(h.seq(r).block_ids) for r in "ab"] == [2, 2]
    assert h.scheduler.num_preemptions == 2
    assert h.scheduler.make_stats().num_preemptions == 2

    third, _ = h.step()  # a and b finish (3 tokens); no room for c and d yet
    assert third.num_scheduled_tokens == {"a": 1, "b": 1}
    assert set(h.finished) == {"a", "b"}

    fourth, _ = h.step()  # c and d resume: their prompt and the output so far are recomputed
    assert fourth.num_scheduled_tokens == {"c": 5, "d": 5}
    assert fourth.finished_request_ids == ["a", "b"]
    resumed = {n.request_id: n for n in fourth.new_requests}
    assert list(resumed) == ["c", "d"]
    for rid in "cd":
        assert resumed[rid].output_token_ids == [default_sampler(rid, 0)]
        assert resumed[rid].prompt_token_ids == h.seq(rid).token_ids[:4]
        assert resumed[rid].num_computed_tokens == 0
        assert resumed[rid].block_ids == h.seq(rid).block_ids

    h.run()
    assert {rid: len(h.output_tokens(rid)) for rid in "abcd"} == {"a": 3, "b": 3, "c": 4, "d": 4}
    # The preempted requests' outputs continue where they left off (the token sampled before preemption
    # is not sampled again).
    assert h.output_tokens("c") == [default_sampler("c", i) for i in range(4)]
    h.assert_no_leaks()


def test_a_request_that_cannot_grow_preempts_itself_and_resumes_from_its_cached_prefix() -> None:
    h = Harness(num_blocks=4, block_size=4)
    h.add("a", prompt(0, 7), max_tokens=2)
    h.add("b", prompt(100, 8), max_tokens=3)

    h.step()  # a: 2 blocks (7 tokens), b: 2 blocks (8 tokens, both full and cached); cache full
    second, _ = h.step()
    # b's 9th token needs a 3rd block; b is itself the most recently admitted, so it goes.
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.finished_request_ids == ["b"]
    assert h.preempted_log[-1] == ["b"]
    assert "a" in h.finished  # a finished in the same step (max_tokens=2)

    third, _ = h.step()
    # b's two prompt blocks were still cached (freed, not reallocated): only its 9th token is recomputed.
    assert third.num_scheduled_tokens == {"b": 1}
    (resumed,) = third.new_requests
    assert resumed.num_computed_tokens == 8
    assert resumed.output_token_ids == [default_sampler("b", 0)]
    assert h.seq("b").num_cached_tokens == 0  # reported cache hits stay those of the first admission
    h.run()
    assert h.output_tokens("b") == [default_sampler("b", i) for i in range(3)]
    assert [o.num_cached_tokens for o in h.outputs["b"]] == [0, 0, 0]
    h.assert_no_leaks()


def test_preempted_partial_prefill_resumes_and_finishes() -> None:
    """A request preempted in the middle of a chunked prefill restarts later from its cached full blocks."""
    h = Harness(num_blocks=5, block_size=4, max_num_batched_tokens=8)
    h.add("a", prompt(0, 4), max_tokens=12)  # grows to 16 tokens: 4 blocks
    h.add("b", prompt(100, 16), max_tokens=1)  # 4 blocks

    assert h.step()[0].num_scheduled_tokens == {"a": 4, "b": 4}
    assert h.step()[0].num_scheduled_tokens == {"a": 1, "b": 7}  # b: 3 blocks, the cache is full
    assert h.seq("b").num_computed_tokens == 11

    third, _ = h.step()  # b's last chunk needs a 4th block: b (admitted last) preempts itself
    assert third.num_scheduled_tokens == {"a": 1}
    assert third.finished_request_ids == ["b"]
    assert h.seq("b").output_token_ids == []  # it had not sampled yet

    resumed = []
    while h.scheduler.has_unfinished_requests():
        out, _ = h.step()
        resumed += [n for n in out.new_requests if n.request_id == "b"]
    # a's growth took b's freed tail blocks (least recently used first), evicting b's second full
    # block; the first was still cached when b came back.
    (resume,) = resumed
    assert (resume.num_computed_tokens, resume.output_token_ids) == (4, [])
    assert sum(h.preempted_log, []) == ["b"]
    assert len(h.output_tokens("a")) == 12
    assert len(h.output_tokens("b")) == 1
    h.assert_no_leaks()


# -- prefix reuse --------------------------------------------------------------------------------------


def test_second_request_reuses_the_cached_prefix_and_computes_only_the_rest() -> None:
    h = Harness(block_size=4)
    shared = prompt(0, 8)
    h.add("a", shared + [50, 51], max_tokens=3)
    first, _ = h.step()
    assert first.num_scheduled_tokens == {"a": 10}

    h.add("b", shared + [60, 61, 62], max_tokens=3)
    second, result = h.step()
    assert second.num_scheduled_tokens == {"a": 1, "b": 3}
    (new,) = second.new_requests
    assert new.num_computed_tokens == 8
    assert h.seq("b").num_cached_tokens == 8
    assert h.seq("b").block_ids[:2] == h.seq("a").block_ids[:2]
    assert h.manager.blocks[h.seq("a").block_ids[0]].ref_count == 2
    assert {o.request_id: o.num_cached_tokens for o in result.outputs} == {"a": 0, "b": 8}
    stats = result.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11, 8)

    h.run()
    h.assert_no_leaks()


def test_identical_prompt_recomputes_its_last_block() -> None:
    h = Harness(block_size=4)
    h.add("a", prompt(0, 8), max_tokens=1)
    h.run()
    h.add("b", prompt(0, 8), max_tokens=1)  # a finished: its blocks are free but still cached
    out, _ = h.step()
    assert out.num_scheduled_tokens == {"b": 4}
    assert out.new_requests[0].num_computed_tokens == 4
    assert h.finished["b"].num_cached_tokens == 4
    h.assert_no_leaks()


def test_without_prefix_caching_everything_is_computed() -> None:
    h = Harness(block_size=4, enable_prefix_caching=False)
    h.add("a", prompt(0, 10))
    h.step()
    h.add("b", prompt(0, 10))
    out, _ = h.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 10}
    assert h.seq("b").num_cached_tokens == 0
    h.run()
    h.assert_no_leaks()


def test_prefix_cache_stats_count_a_request_once_however_long_it_waits() -> None:
    h = Harness(num_blocks=3, block_size=4)
    h.add("a", prompt(0, 11), max_tokens=2)  # 3 blocks: the whole cache
    h.add("b", prompt(0, 4) + prompt(900, 4), max_tokens=1)  # shares a's first block, needs one more

    first, _ = h.step()
    assert first.num_scheduled_tokens == {"a": 11}  # b waits: no free block
    second, _ = h.step()
    assert second.num_scheduled_tokens == {"a": 1}  # still no free block; a finishes
    third, result = h.step()
    assert third.num_scheduled_tokens == {"b": 4}  # b admitted with its first block from the cache
    assert h.finished["b"].num_cached_tokens == 4

    stats = result.scheduler_stats
    # One query per admitted request: a (11 tokens, no hit) and b (8 tokens, 4 hit).
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (11 + 8, 4)


# -- stops ---------------------------------------------------------------------------------------------


def test_stop_token_ends_the_request_with_it_as_stop_reason() -> None:
    h = Harness(sampler=scripted({"a": [5, 6, 99, 7]}))
    h.add("a", prompt(0, 3), max_tokens=10, stop_token_ids=(99,), eos_token_ids=(2,))
    h.run()
    assert h.output_tokens("a") == [5, 6, 99]  # the stop token itself is output
    final = h.finished["a"]
    assert (final.finish_reason, final.stop_reason) == ("stop", 99)
    assert [o.finish_reason for o in h.outputs["a"]] == [None, None, "stop"]
    h.assert_no_leaks()


def test_eos_stops_with_no_stop_reason() -> None:
    h = Harness(sampler=scripted({"a": [5, 2, 7]}))
    h.add("a", prompt(0, 3), max_tokens=10, eos_token_ids=(2, 3))
    h.run()
    assert h.output_tokens("a") == [5, 2]
    assert (h.finished["a"].finish_reason, h.finished["a"].stop_reason) == ("stop", None)


def test_eos_and_stop_tokens_are_ignored_before_min_tokens() -> None:
    # Outputs 1..2 are EOS / stop tokens but min_tokens=3 has not been reached: ignored.
    h = Harness(sampler=scripted({"a": [2, 99, 7, 8, 2, 9]}))
    h.add("a", prompt(0, 3), max_tokens=10, min_tokens=3, stop_token_ids=(99,), eos_token_ids=(2,))
    h.run()
    assert h.output_tokens("a") == [2, 99, 7, 8, 2]
    assert (h.finished["a"].finish_reason, h.finished["a"].stop_reason) == ("stop", None)


def test_max_tokens_finishes_with_length() -> None:
    h = Harness()
    h.add("a", prompt(0, 3), max_tokens=3)
    h.run()
    assert len(h.output_tokens("a")) == 3
    assert (h.finished["a"].finish_reason, h.finished["a"].stop_reason) == ("length", None)
    assert [o.finished for o in h.outputs["a"]] == [False, False, True]


def test_max_model_len_finishes_with_length() -> None:
    h = Harness(max_model_len=10)
    h.add("a", prompt(0, 7), max_tokens=100)
    h.run()
    assert len(h.output_tokens("a")) == 3  # 7 + 3 = max_model_len tokens in all
    assert h.finished["a"].finish_reason == "length"


def test_stop_token_on_the_last_allowed_token_reports_stop() -> None:
    # Both a stop token and max_tokens end the request here; the scheduler reports the stop token
    # (vLLM's check_stop reports "length" in this case: see the report that came with this test).
    h = Harness(sampler=scripted({"a": [5, 99]}))
    h.add("a", prompt(0, 3), max_tokens=2, stop_token_ids=(99,))
    h.run()
    assert (h.finished["a"].finish_reason, h.finished["a"].stop_reason) == ("stop", 99)


# -- aborts --------------------------------------------------------------------------------------------


def test_abort_of_a_waiting_request_never_reaches_the_worker() -> None:
    h = Harness(max_num_seqs=1)
    h.add("a", prompt(0, 3), max_tokens=3)
    h.add("b", prompt(100, 3))
    h.step()
    assert h.abort(["b", "unknown"]) == ["b"]
    assert "b" not in h.scheduler.sequences
    out, _ = h.step()
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.finished_request_ids == []  # the worker never knew b
    h.run()
    assert "b" not in h.outputs
    h.assert_no_leaks()


def test_abort_of_a_running_request_frees_its_blocks_and_emits_nothing_more() -> None:
    h = Harness()
    h.add("a", prompt(0, 9), max_tokens=10)
    h.add("b", prompt(100, 5), max_tokens=10)
    h.step()
    free_before = h.manager.num_free_blocks
    a_blocks = len(h.seq("a").block_ids)

    assert h.abort(["a"]) == ["a"]
    assert h.manager.num_free_blocks == free_before + a_blocks
    out, result = h.step()
    assert out.finished_request_ids == ["a"]
    assert out.num_scheduled_tokens == {"b": 1}
    assert [o.request_id for o in result.outputs] == ["b"]
    assert len(h.output_tokens("a")) == 1  # only the token of the step before the abort
    assert h.abort(["a"]) == []  # already gone: ignored
    h.run()
    h.assert_no_leaks()


def test_abort_while_the_step_runs_drops_its_output() -> None:
    h = Harness()
    h.add("a", prompt(0, 5))
    h.add("b", prompt(100, 5))
    _, result = h.step(abort_in_flight=["a"])
    assert [o.request_id for o in result.outputs] == ["b"]
    assert "a" not in h.outputs
    out, _ = h.step()
    assert out.finished_request_ids == ["a"]
    h.run()
    h.assert_no_leaks()


def test_abort_of_a_preempted_request_is_not_forgotten_twice() -> None:
    h = Harness(num_blocks=2, block_size=4)
    h.add("a", prompt(0, 4), max_tokens=3)
    h.add("b", prompt(100, 4), max_tokens=3)
    h.step()
    second, _ = h.step()
    assert second.finished_request_ids == ["b"]  # preempted
    assert h.abort(["b"]) == ["b"]
    third, _ = h.step()
    assert third.finished_request_ids == []  # the worker already forgot b when it was preempted
    h.run()
    assert len(h.output_tokens("b")) == 1
    h.assert_no_leaks()


# -- randomized: everything finishes or is aborted, nothing leaks --------------------------------------


def random_sampler(request_id: str, index: int) -> int:
    return random.Random(f"{request_id}/{index}").randrange(40)


@pytest.mark.parametrize(
    ("seed", "chunked", "prefix_caching"),
    [(0, True, True), (1, True, True), (2, False, True), (3, True, False), (4, False, False)],
)
def test_random_load_with_preemption_and_aborts_leaks_no_blocks(seed: int, chunked: bool, prefix_caching: bool) -> None:
    rng = random.Random(seed)
    block_size = 4
    max_model_len = 48
    h = Harness(
        num_blocks=max_model_len // block_size + 4,  # room for one longest sequence and a little more
        block_size=block_size,
        max_num_seqs=6,
        max_num_batched_tokens=max_model_len if not chunked else 16,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=prefix_caching,
        sampler=random_sampler,
    )
    bases = [[rng.randrange(40) for _ in range(24)] for _ in range(3)]  # shared prefixes
    params: dict[str, dict] = {}
    aborted: set[str] = set()
    num_in_flight_aborts = 0
    next_id = 0

    for step in range(600):
        if step < 450 and rng.random() < 0.25:
            for _ in range(rng.randint(1, 2)):
                rid = f"r{next_id}"
                next_id += 1
                base = rng.choice(bases)
                body = base[: rng.randint(0, len(base))] + [rng.randrange(40) for _ in range(rng.randint(1, 12))]
                sampling = {
                    "max_tokens": rng.randint(1, 20),
                    "min_tokens": rng.choice([0, 0, 2]),
                    "stop_token_ids": tuple(rng.sample(range(40), rng.choice([0, 1]))),
                    "eos_token_ids": (39,),
                }
                sampling["min_tokens"] = min(sampling["min_tokens"], sampling["max_tokens"])
                params[rid] = {"prompt": body[: max_model_len - 1], **sampling}
                h.add(rid, params[rid]["prompt"], **sampling)
        aborted.update(h.abort([rid for rid in h.scheduler.sequences if rng.random() < 0.004]))
        in_flight = [rid for rid in h.scheduler.sequences if rng.random() < 0.004]
        if h.scheduler.has_unfinished_requests():
            h.step(abort_in_flight=in_flight)
            aborted.update(in_flight)
            num_in_flight_aborts += len(in_flight)
        elif step >= 450:
            break

    h.run()
    h.step()  # one more step hands the last finished ids to the worker
    assert h.worker.requests == {}
    h.assert_no_leaks()

    # The load exercised what it is meant to: preemption, and aborts of every kind.
    assert sum(len(p) for p in h.preempted_log) > 0, "the load never preempted"
    assert set(h.aborted_while) == aborted and len(aborted) < len(params) / 2
    assert {SequenceStatus.WAITING, SequenceStatus.RUNNING} <= set(h.aborted_while.values())
    assert num_in_flight_aborts > 0
    if prefix_caching:
        assert h.manager.prefix_cache_hits > 0
    for rid, p in params.items():
        tokens = h.output_tokens(rid)
        # Every output is the token the worker sampled, in order, whatever the preemptions.
        assert tokens == h.worker.sampled[rid][: len(tokens)]
        if rid in aborted:
            assert h.finished[rid].finish_reason == "abort"
            continue
        final = h.finished[rid]
        assert final.finish_reason in ("stop", "length")
        stops = set(p["stop_token_ids"]) | set(p["eos_token_ids"])
        early = [t for t in tokens[p["min_tokens"] - 1 if p["min_tokens"] else 0 : -1] if t in stops]
        assert not early, f"{rid} went past a stop token"
        if final.finish_reason == "length":
            assert len(tokens) == p["max_tokens"] or len(p["prompt"]) + len(tokens) == max_model_len
        else:
            assert tokens[-1] in stops and len(tokens) >= p["min_tokens"]
            assert final.stop_reason == (tokens[-1] if tokens[-1] in p["stop_token_ids"] else None)
