"""AsyncEngine behaviour on trio and asyncio: streaming, concurrency, every abort path, overload, ids.

Every test starts an in-process engine on the tiny Llama (token-id prompts, no tokenizer). A request
that stops early must leave the scheduler leak-free (nothing running or waiting, no KV block in
use); aborts reach the engine core asynchronously, so `wait_until_idle` polls for that.
"""

from __future__ import annotations

import random
import time
from contextlib import aclosing

import anyio
import pytest

from asyncengine import AsyncEngine, EngineDeadError, EngineOverloadedError, RequestError, SamplingParams
from asyncengine.frontend.output_processor import OutputKind
from support.engine_checks import assert_all_blocks_free

pytestmark = pytest.mark.anyio

LONG = 450  # max_tokens of a request that is stopped long before it could finish (max_model_len 512: room
# for it after the longest prompt here, 40 tokens; an explicit max_tokens past the context is refused)


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")  # built here, in a sync fixture: building blocks the event loop


# The admission tests hold the queue full with a LONG request while they act at the gate (0.2 s and more): on
# the modules' path its 450 steps take seconds; the one-call CPU decode step (worker/cpu_decode.py) runs the
# tiny model's 450 steps in a fraction of that, so the request would end before the test looks. Eager mode keeps
# the modules' path; the decode step has its own tests (tests/worker/test_cpu_decode.py).
HELD_LONG = dict(enforce_eager=True)


def start_engine(model, **overrides) -> AsyncEngine:
    options = dict(
        model=str(model.path), skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20
    )
    options.update(overrides)
    return AsyncEngine.start(**options)


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def prompt(token_ids: list[int]) -> dict:
    return {"prompt_token_ids": list(token_ids)}


def random_prompts(count: int, vocab_size: int, *, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(count)]


async def collect_tokens(engine: AsyncEngine, token_ids: list[int], params: SamplingParams, **kwargs) -> list[int]:
    tokens: list[int] = []
    async for output in engine.generate(prompt(token_ids), params, **kwargs):
        tokens += output.outputs[0].token_ids
    return tokens


async def wait_until_idle(engine: AsyncEngine, timeout: float = 10.0):
    """Poll until nothing runs or waits and no KV block is in use; then return the stats.

    The deadline is in real time (time.monotonic), so this also works under trio's autojump clock.
    """
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.get_scheduler_stats()
        if (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the scheduler did not drain within {timeout} s: {stats}")
        await anyio.sleep(0.02)


async def wait_for_stats(engine: AsyncEngine, condition, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.get_scheduler_stats()
        if condition(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {stats}")
        await anyio.sleep(0.01)


async def assert_still_serves(engine: AsyncEngine) -> None:
    with anyio.fail_after(30):
        tokens = await collect_tokens(engine, [11, 12, 13], greedy(4))
    assert len(tokens) == 4
    assert_all_blocks_free(await wait_until_idle(engine))


# -- streaming -------------------------------------------------------------------------------------------


async def test_stream_deltas_add_up_to_the_final_output(llama):
    prompts = random_prompts(4, llama.vocab_size, seed=1, lengths=(1, 70))
    params = greedy(24, logprobs=2)
    async with start_engine(llama) as engine:
        # The non-streamed result of each prompt, from the same engine: one FINAL_ONLY output each.
        finals = []
        for token_ids in prompts:
            processed = engine.process_request(prompt(token_ids), params)
            outputs = [o async for o in engine.submit(processed, OutputKind.FINAL_ONLY)]
            assert len(outputs) == 1 and outputs[0].finished
            finals.append(outputs[0].outputs[0])

        deltas: dict[int, list] = {}

        async def stream(index: int) -> None:
            deltas[index] = [o async for o in engine.generate(prompt(prompts[index]), params, request_id=f"s{index}")]

        async with anyio.create_task_group() as tg:
            for index in range(len(prompts)):
                tg.start_soon(stream, index)

        for index, final in enumerate(finals):
            outputs = deltas[index]
            assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
            assert all(o.request_id == f"s{index}" for o in outputs)
            assert all(o.prompt_token_ids == prompts[index] for o in outputs)
            tokens, logprobs = [], []
            for output in outputs:
                (completion,) = output.outputs
                assert completion.index == 0
                assert completion.token_ids, "a delta without a new token"
                assert len(completion.logprobs) == len(completion.token_ids)
                if not output.finished:
                    assert completion.finish_reason is None
                tokens += completion.token_ids
                logprobs += completion.logprobs
            last = outputs[-1].outputs[0]
            assert (last.finish_reason, len(tokens)) == ("length", 24)
            assert tokens == final.token_ids
            # Logprobs may differ in the last bits: the streamed runs shared batches, the reference ran alone.
            assert [sorted(step) for step in logprobs] == [sorted(step) for step in final.logprobs]
            for step, final_step in zip(logprobs, final.logprobs):
                assert step == pytest.approx(final_step, abs=1e-4)
            assert last.cumulative_logprob == pytest.approx(final.cumulative_logprob, abs=1e-3)
            for token, step in zip(tokens, logprobs):
                assert token in step and step[token] == max(step.values())  # greedy: the chosen token is top-1
        assert_all_blocks_free(await wait_until_idle(engine))


async def test_a_late_reader_gets_what_it_missed_in_one_delta(llama):
    """Outputs produced while the consumer was away are merged, not dropped or repeated."""
    params = greedy(16)
    async with start_engine(llama) as engine:
        reference = await collect_tokens(engine, [7, 8, 9], params)
        outputs = engine.generate(prompt([7, 8, 9]), params)
        first = await outputs.__anext__()
        assert not first.finished
        await wait_until_idle(engine)  # the request finished in the engine core meanwhile
        await engine.get_scheduler_stats()  # one more round trip: its last step output was handled before this
        rest = await outputs.__anext__()
        assert rest.finished and rest.outputs[0].finish_reason == "length"
        assert first.outputs[0].token_ids + rest.outputs[0].token_ids == reference
        with pytest.raises(StopAsyncIteration):
            await outputs.__anext__()


# -- many requests at once -------------------------------------------------------------------------------


async def test_64_concurrent_requests_match_their_solo_runs(llama):
    prompts = random_prompts(64, llama.vocab_size, seed=2, lengths=(1, 120))
    params = [greedy(4 + index % 13) for index in range(len(prompts))]
    async with start_engine(llama) as engine:
        solo = [await collect_tokens(engine, p, sp) for p, sp in zip(prompts, params)]

        results: dict[int, list[int]] = {}
        finish_reasons: dict[int, str] = {}
        most_running = 0

        async def one(index: int) -> None:
            nonlocal most_running
            tokens = []
            async for output in engine.generate(prompt(prompts[index]), params[index]):
                tokens += output.outputs[0].token_ids
                finish_reasons[index] = output.outputs[0].finish_reason
                if engine.last_scheduler_stats is not None:
                    most_running = max(most_running, engine.last_scheduler_stats.num_running_reqs)
            results[index] = tokens

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for index in range(len(prompts)):
                    tg.start_soon(one, index)

        assert most_running > 1, "the requests never ran in one batch"
        for index in range(len(prompts)):
            assert len(results[index]) == params[index].max_tokens
            assert finish_reasons[index] == "length"
            assert results[index] == solo[index], f"request {index} differs from its solo run"
        assert_all_blocks_free(await wait_until_idle(engine))


# -- abort paths -----------------------------------------------------------------------------------------


ABORT_PATHS = ["abort", "cancel_scope", "aclose", "aclosing", "stream_context"]


@pytest.mark.parametrize("path", ABORT_PATHS)
async def test_every_abort_path_frees_the_blocks(llama, path):
    params = greedy(LONG)
    async with start_engine(llama) as engine:
        received: list = []
        request_id = f"abort-{path}"
        token_ids = list(range(20, 60))  # 40 tokens: several KV blocks

        async def blocks_in_use() -> None:
            stats = await engine.get_scheduler_stats()
            assert stats.kv_cache_usage > 0.0 and stats.num_running_reqs == 1, stats

        if path == "abort":
            async for output in engine.generate(prompt(token_ids), params, request_id=request_id):
                received.append(output)
                if len(received) == 3:
                    await blocks_in_use()
                    await engine.abort(request_id)
            # The consumer is told: a last output, finished, with finish_reason "abort".
            last = received[-1]
            assert last.finished and last.outputs[0].finish_reason == "abort"
            assert not any(o.finished for o in received[:-1])
        elif path == "cancel_scope":
            with anyio.CancelScope() as scope:
                async for output in engine.generate(prompt(token_ids), params, request_id=request_id):
                    received.append(output)
                    if len(received) == 3:
                        await blocks_in_use()
                        scope.cancel()
            assert scope.cancelled_caught
        elif path == "aclose":
            outputs = engine.generate(prompt(token_ids), params, request_id=request_id)
            for _ in range(3):
                received.append(await outputs.__anext__())
            await blocks_in_use()
            await outputs.aclose()
        elif path == "aclosing":
            async with aclosing(engine.generate(prompt(token_ids), params, request_id=request_id)) as outputs:
                async for output in outputs:
                    received.append(output)
                    if len(received) == 3:
                        await blocks_in_use()
                        break
        elif path == "stream_context":
            async with engine.stream(prompt(token_ids), params, request_id=request_id) as outputs:
                async for output in outputs:
                    received.append(output)
                    if len(received) == 3:
                        await blocks_in_use()
                        break

        num_tokens = sum(len(o.outputs[0].token_ids) for o in received)
        assert 3 <= num_tokens < LONG
        if path != "abort":
            assert not any(o.finished for o in received)
        assert_all_blocks_free(await wait_until_idle(engine))
        await assert_still_serves(engine)


@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_an_aborted_id_can_be_reused_at_once(llama, async_scheduling):
    async with start_engine(llama, async_scheduling=async_scheduling) as engine:
        received = 0
        async for _ in engine.generate(prompt(list(range(20, 60))), greedy(LONG), request_id="reused"):
            received += 1
            if received == 3:
                await engine.abort("reused")  # a step is still in flight for it
        with anyio.fail_after(30):
            tokens = await collect_tokens(engine, [1, 2, 3], greedy(3), request_id="reused")
        assert tokens == await collect_tokens(engine, [1, 2, 3], greedy(3), request_id="fresh")
        assert_all_blocks_free(await wait_until_idle(engine))


async def test_abort_of_a_request_waiting_in_the_engine_core(llama):
    async with start_engine(llama, max_num_seqs=1) as engine:
        async with anyio.create_task_group() as tg:
            outputs: dict[str, list] = {"running": [], "queued": []}

            async def run(name: str) -> None:
                async for output in engine.generate(prompt([5, 6, 7]), greedy(LONG), request_id=name):
                    outputs[name].append(output)

            tg.start_soon(run, "running")
            await wait_for_stats(engine, lambda s: s.num_running_reqs == 1, "the first request to run")
            tg.start_soon(run, "queued")
            await wait_for_stats(engine, lambda s: s.num_waiting_reqs == 1, "the second request to queue")
            await engine.abort("queued")
            await wait_for_stats(engine, lambda s: s.num_waiting_reqs == 0, "the queued request to go")
            await engine.abort("running")
        (queued_last,) = outputs["queued"]  # it never ran: its only output is the abort
        assert queued_last.finished and queued_last.outputs[0].finish_reason == "abort"
        assert queued_last.outputs[0].token_ids == []
        assert outputs["running"][-1].outputs[0].finish_reason == "abort"
        assert_all_blocks_free(await wait_until_idle(engine))
        await assert_still_serves(engine)


async def test_abort_of_an_unknown_or_finished_request_is_harmless(llama):
    async with start_engine(llama) as engine:
        await engine.abort("never-existed")
        assert len(await collect_tokens(engine, [4, 5], greedy(3), request_id="done")) == 3
        await engine.abort("done")
        await assert_still_serves(engine)


# -- overload --------------------------------------------------------------------------------------------


async def test_nowait_raises_when_the_waiting_queue_is_full(llama):
    short = greedy(5)
    async with start_engine(llama, max_num_seqs=1, max_waiting_requests=2, **HELD_LONG) as engine:
        results: dict[str, list] = {}
        first_token = anyio.Event()

        async def run(name: str, token_ids: list[int], params: SamplingParams) -> None:
            results[name] = []
            async for output in engine.generate(prompt(token_ids), params, request_id=name):
                results[name].append(output)
                first_token.set()

        # nowait with room to spare is accepted.
        assert len(await collect_tokens(engine, [3, 4], short, nowait=True)) == 5

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "long", [5, 6, 7], greedy(LONG))
            await first_token.wait()  # running: it no longer counts as waiting
            tg.start_soon(run, "w1", [8, 9], short)
            tg.start_soon(run, "w2", [10, 11], short)
            await wait_for_stats(
                engine, lambda s: (s.num_running_reqs, s.num_waiting_reqs) == (1, 2), "1 running and 2 waiting"
            )

            overloaded = engine.generate(prompt([12, 13]), short, request_id="rejected", nowait=True)
            with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
                await overloaded.__anext__()

            # Without nowait the request waits for room instead (and is not queued in the core yet).
            tg.start_soon(run, "patient", [12, 13], short)
            await anyio.sleep(0.1)
            stats = await engine.get_scheduler_stats()
            assert not results["long"][-1].finished, "the long request ended before the check: make it longer"
            assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 2), stats
            assert results["patient"] == []
            await engine.abort("long")  # room frees: w1 runs, w2 and then patient follow

        assert results["long"][-1].outputs[0].finish_reason == "abort"
        for name in ("w1", "w2", "patient"):
            assert results[name][-1].finished and results[name][-1].outputs[0].finish_reason == "length"
            assert sum(len(o.outputs[0].token_ids) for o in results[name]) == 5
        # The rejected request left nothing behind: its id is free.
        assert len(await collect_tokens(engine, [12, 13], short, request_id="rejected")) == 5
        assert_all_blocks_free(await wait_until_idle(engine))


async def test_every_way_out_gives_the_admission_place_back(llama):
    """Requests cancelled at the gate, aborted while queued in the engine core, rejected or finished all
    give their place under max_waiting_requests back: afterwards the queue takes exactly 2 again."""
    async with start_engine(llama, max_num_seqs=1, max_waiting_requests=2, **HELD_LONG) as engine:
        results: dict[str, list] = {}

        async def run(name: str, params: SamplingParams, *, nowait: bool = False) -> None:
            results[name] = [o async for o in engine.generate(prompt([5, 6]), params, request_id=name, nowait=nowait)]

        async def fill(prefix: str) -> None:
            """One request running, two queued in the engine core."""
            tg.start_soon(run, f"{prefix}-long", greedy(LONG))
            await wait_for_stats(engine, lambda s: s.num_running_reqs == 1, "a running request")
            tg.start_soon(run, f"{prefix}-q1", greedy(LONG))
            tg.start_soon(run, f"{prefix}-q2", greedy(LONG))
            await wait_for_stats(engine, lambda s: s.num_waiting_reqs == 2, "two queued requests")

        async with anyio.create_task_group() as tg:
            await fill("a")
            with anyio.move_on_after(0.2) as scope:  # waits at the gate, then is cancelled there
                await run("cancelled-at-gate", greedy(5))
            assert scope.cancelled_caught
            with pytest.raises(EngineOverloadedError):
                await run("rejected", greedy(5), nowait=True)
            for name in ("a-q2", "a-q1", "a-long"):  # queued ones first, so nothing else gets admitted
                await engine.abort(name)
            assert_all_blocks_free(await wait_until_idle(engine))

            # Exactly two places again: one running, two queued, and a third is refused.
            await fill("b")
            with pytest.raises(EngineOverloadedError):
                await run("refused", greedy(5), nowait=True)
            for name in ("b-q2", "b-q1", "b-long"):
                await engine.abort(name)
        assert all(results[name][-1].outputs[0].finish_reason == "abort" for name in results if name[1] == "-")
        assert "cancelled-at-gate" not in results and "rejected" not in results
        assert_all_blocks_free(await wait_until_idle(engine))
        await assert_still_serves(engine)


async def test_abort_of_a_request_waiting_for_admission(llama):
    async with start_engine(llama, max_num_seqs=1, max_waiting_requests=1, **HELD_LONG) as engine:
        results: dict[str, list] = {}

        async def run(name: str, params: SamplingParams) -> None:
            results[name] = [o async for o in engine.generate(prompt([5, 6]), params, request_id=name)]

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "long", greedy(LONG))
            await wait_for_stats(engine, lambda s: s.num_running_reqs == 1, "a running request")
            tg.start_soon(run, "queued", greedy(5))
            await wait_for_stats(engine, lambda s: s.num_waiting_reqs == 1, "a queued request")
            tg.start_soon(run, "at-the-gate", greedy(5))  # max_waiting_requests=1: it waits for room
            await anyio.sleep(0.2)
            await engine.abort("at-the-gate")
            # Its consumer learns it at once, while the queue is still full.
            with anyio.move_on_after(5):
                while "at-the-gate" not in results:
                    await anyio.sleep(0.01)
            still_full = await engine.get_scheduler_stats()
            await engine.abort("long")
        assert (still_full.num_running_reqs, still_full.num_waiting_reqs) == (1, 1), still_full
        assert "at-the-gate" in results, "the consumer of a request aborted at the admission gate was not told"
        (last,) = results["at-the-gate"]
        assert last.finished and last.outputs[0].finish_reason == "abort" and last.outputs[0].token_ids == []
        assert results["queued"][-1].outputs[0].finish_reason == "length"
        assert_all_blocks_free(await wait_until_idle(engine))


# -- deadlines in virtual time (trio's autojump clock) ---------------------------------------------------


class TestDeadlineUnderAutojumpClock:
    """A consumer's deadline in virtual time (trio's MockClock) cancels its stream mid-way.

    The clock's autojump (threshold 0) is on only from the moment the deadline is set until the
    cancellation lands, and for the final polling. With it on, trio polls for I/O with a zero
    timeout whenever every task waits, a busy loop: waiting for the worker thread, it competes with
    that thread for the GIL and the two cores, and a model step becomes 10 to 1000 times slower (we
    measured this test's concurrent phase at 0.1 s to 150 s with autojump on throughout). With the
    autojump off and the clock's rate 0, virtual time stands still while the streams run.
    """

    @pytest.fixture
    def anyio_backend(self, request):
        import trio.testing

        from support.loop_guard import LoopBlockingGuard

        guard = LoopBlockingGuard()
        request.node.loop_guard = guard
        clock = trio.testing.MockClock(autojump_threshold=0)
        request.node.mock_clock = clock
        return ("trio", {"clock": clock, "instruments": [guard]})

    async def test_a_deadline_cancels_one_stream_mid_way(self, llama, request):
        clock = request.node.mock_clock
        clock.autojump_threshold = float("inf")
        prompts = random_prompts(3, llama.vocab_size, seed=3, lengths=(5, 40))
        params = greedy(40)
        async with start_engine(llama) as engine:
            solo = [await collect_tokens(engine, p, params) for p in prompts]
            results: dict[int, list[int]] = {}
            cancelled: list[int] = []
            timing: dict[str, float] = {}

            async def other(index: int) -> None:
                results[index] = await collect_tokens(engine, prompts[index], params)

            async def with_deadline() -> None:
                with anyio.CancelScope() as scope:
                    async for output in engine.generate(prompt([9, 8, 7, 6]), greedy(LONG)):
                        cancelled.extend(output.outputs[0].token_ids)
                        if len(cancelled) >= 10 and scope.deadline == float("inf"):
                            timing["set_at"] = anyio.current_time()
                            timing["real_set_at"] = time.monotonic()
                            scope.deadline = timing["set_at"] + 5.0
                            clock.autojump_threshold = 0
                clock.autojump_threshold = float("inf")
                assert scope.cancelled_caught
                timing["cancelled_at"] = anyio.current_time()
                timing["real_cancelled_at"] = time.monotonic()

            async with anyio.create_task_group() as tg:
                tg.start_soon(with_deadline)
                for index in range(len(prompts)):
                    tg.start_soon(other, index)

            assert 10 <= len(cancelled) < LONG
            assert timing["cancelled_at"] >= timing["set_at"] + 5.0  # virtual seconds...
            assert timing["real_cancelled_at"] - timing["real_set_at"] < 4.0  # ...that passed without waiting
            for index in range(len(prompts)):
                assert results[index] == solo[index]
            clock.autojump_threshold = 0  # wait_until_idle sleeps between polls
            assert_all_blocks_free(await wait_until_idle(engine))


# -- request ids -----------------------------------------------------------------------------------------


async def test_request_ids(llama):
    params = greedy(12)
    async with start_engine(llama) as engine:
        outputs = engine.generate(prompt([5, 6, 7]), params, request_id="my-request")
        first = await outputs.__anext__()
        assert first.request_id == "my-request"

        # While it is in flight, its id cannot be used again.
        duplicate = engine.generate(prompt([1, 2]), params, request_id="my-request")
        with pytest.raises(RequestError) as info:
            await duplicate.__anext__()
        assert info.value.field == "request_id"

        rest = [o async for o in outputs]
        assert all(o.request_id == "my-request" for o in rest)
        tokens = first.outputs[0].token_ids + [t for o in rest for t in o.outputs[0].token_ids]
        assert tokens == await collect_tokens(engine, [5, 6, 7], params)  # the duplicate did not disturb it

        # Finished: the id can be used again.
        again = [o async for o in engine.generate(prompt([5, 6, 7]), params, request_id="my-request")]
        assert {o.request_id for o in again} == {"my-request"}

        for bad in ("", 17):
            with pytest.raises(RequestError) as info:
                await engine.generate(prompt([1]), params, request_id=bad).__anext__()
            assert info.value.field == "request_id"

        # Without an id each request gets its own.
        ids: list[set[str]] = []

        async def anonymous() -> None:
            ids.append({o.request_id async for o in engine.generate(prompt([3, 4]), greedy(3))})

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(anonymous)
        assert all(len(s) == 1 for s in ids) and len(set.union(*ids)) == 3
        assert_all_blocks_free(await wait_until_idle(engine))


async def test_duplicate_ids_waiting_for_admission(llama):
    async with start_engine(llama, max_num_seqs=1, max_waiting_requests=1, **HELD_LONG) as engine:
        outcome: dict[str, list] = {"ok": [], "rejected": [], "dead": []}

        async def run(name: str, params: SamplingParams) -> None:
            try:
                tokens = await collect_tokens(engine, [5, 6, 7], params, request_id=name)
            except RequestError:
                outcome["rejected"].append(name)
            except EngineDeadError:
                outcome["dead"].append(name)
            else:
                outcome["ok"].append((name, len(tokens)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "running", greedy(LONG))
            await wait_for_stats(engine, lambda s: s.num_running_reqs == 1, "a running request")
            tg.start_soon(run, "queued", greedy(3))
            await wait_for_stats(engine, lambda s: s.num_waiting_reqs == 1, "a queued request")
            tg.start_soon(run, "dup", greedy(3))  # both wait for room at the admission gate
            tg.start_soon(run, "dup", greedy(3))
            await anyio.sleep(0.2)
            await engine.abort("running")
        assert outcome["dead"] == []
        assert outcome["rejected"] == ["dup"]  # one of the two, at submission or once admitted
        assert sorted(item for item in outcome["ok"] if item[0] != "running") == [("dup", 3), ("queued", 3)]
        await assert_still_serves(engine)


async def test_user_id_that_looks_like_a_child_id(llama):
    async with start_engine(llama) as engine:
        outcome: dict[str, object] = {}

        async def run(name: str, params: SamplingParams) -> None:
            try:
                outputs = [o async for o in engine.generate(prompt([5, 6, 7]), params, request_id=name)]
            except RequestError:
                outcome[name] = "rejected"
            except EngineDeadError:
                outcome[name] = "dead"
            else:
                outcome[name] = outputs

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "x#1", greedy(LONG))
            await wait_for_stats(engine, lambda s: s.num_running_reqs == 1, "x#1 to run")
            await run("x", greedy(30, n=2))
            await engine.abort("x#1")
        assert outcome["x#1"] not in ("dead", "rejected")
        assert outcome["x#1"][-1].outputs[0].finish_reason == "abort"  # it ran until aborted
        # Either "x" is refused (its engine-core ids are taken) or both completions run to the end.
        if outcome["x"] != "rejected":
            assert outcome["x"] != "dead"
            lengths = {0: 0, 1: 0}
            for output in outcome["x"]:
                for completion in output.outputs:
                    lengths[completion.index] += len(completion.token_ids)
            assert lengths == {0: 30, 1: 30}
        await assert_still_serves(engine)


async def test_after_shutdown_requests_are_refused(llama):
    async with start_engine(llama) as engine:
        await assert_still_serves(engine)
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        await engine.generate(prompt([1, 2]), greedy(2)).__anext__()


def test_async_engine_is_a_public_name():
    import asyncengine
    from asyncengine.frontend.async_engine import AsyncEngine as Implementation

    assert AsyncEngine is Implementation and "AsyncEngine" in asyncengine.__all__  # ARCHITECTURE.md, "Public names"
