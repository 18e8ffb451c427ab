"""Stat loggers: what `record` gets per step, `log()` on a timer, and a raising logger killing the engine.

The engine tests start an in-process engine on the tiny Llama (token-id prompts, no tokenizer) on trio
and asyncio. The StatsTracker tests feed it engine-core outputs by hand, with made-up times.
"""

from __future__ import annotations

import time

import anyio
import pytest

from asyncengine import AsyncEngine, EngineDeadError, SamplingParams
from asyncengine.config.engine import EngineConfig
from asyncengine.errors import StartupError
from asyncengine.frontend.stat_logging import plugin_stat_loggers as _plugin_stat_loggers
from asyncengine.frontend.iteration_stats import FinishedRequestStats, IterationStats, StatsTracker
from asyncengine.interfaces.stat_logger import StatLoggerBase
from asyncengine.wire.engine_core import EngineCoreOutput, EngineCoreRequest, SamplingOptions, SchedulerStats

LONG = 480  # max_tokens of a request that is stopped long before it could finish (max_model_len 512)
ENGINE_OPTIONS = dict(skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20)


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")  # built here, in a sync fixture: building blocks the event loop


def start_engine(model, **overrides) -> AsyncEngine:
    return AsyncEngine.start(model=str(model.path), **{**ENGINE_OPTIONS, **overrides})


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def prompt(token_ids: list[int]) -> dict:
    return {"prompt_token_ids": list(token_ids)}


async def collect_tokens(engine: AsyncEngine, token_ids: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for output in engine.generate(prompt(token_ids), params):
        tokens += output.outputs[0].token_ids
    return tokens


async def wait_for(condition, what: str, timeout: float = 10.0) -> None:
    """Poll `condition` in real time (an async logger may record a step after its outputs went out)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await anyio.sleep(0.01)


class RecordingLogger(StatLoggerBase):
    def __init__(self, engine_config=None) -> None:
        super().__init__(engine_config)
        self.records: list[tuple[SchedulerStats | None, IterationStats]] = []
        self.logs = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.records.append((scheduler_stats, iteration_stats))

    def log(self) -> None:
        self.logs += 1

    @property
    def iterations(self) -> list[IterationStats]:
        return [iteration for _, iteration in self.records]

    def finished(self) -> list[FinishedRequestStats]:
        return [finished for iteration in self.iterations for finished in iteration.finished_requests]


class AsyncRecordingLogger(RecordingLogger):
    async def record(self, scheduler_stats, iteration_stats) -> None:
        await anyio.sleep(0)
        super().record(scheduler_stats, iteration_stats)

    async def log(self) -> None:
        await anyio.sleep(0)
        self.logs += 1


class ExplodingLogger(StatLoggerBase):
    def __init__(self, method: str) -> None:
        super().__init__()
        self.method = method

    def record(self, scheduler_stats, iteration_stats) -> None:
        if self.method == "record":
            raise RuntimeError("the record blew up")

    def log(self) -> None:
        if self.method == "log":
            raise RuntimeError("the log blew up")


# -- through the engine --------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("logger_cls", [RecordingLogger, AsyncRecordingLogger], ids=["sync", "async"])
async def test_a_logger_gets_every_steps_tokens_latencies_and_finishes(llama, logger_cls):
    prompts = [[5, 6, 7], list(range(10, 30)), list(range(40, 47))]
    max_tokens = [5, 8, 3]
    async with start_engine(llama) as engine:
        with pytest.raises(TypeError, match="add_stat_logger needs a StatLoggerBase instance, got 'nope'"):
            engine.add_stat_logger("nope")
        stat_logger = logger_cls()
        engine.add_stat_logger(stat_logger)
        assert engine.stat_loggers == (stat_logger,)
        generated: dict[int, list[int]] = {}

        async def run(index: int) -> None:
            generated[index] = await collect_tokens(engine, prompts[index], greedy(max_tokens[index]))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for index in range(len(prompts)):
                    tg.start_soon(run, index)
            await wait_for(lambda: len(stat_logger.finished()) == 3, "three finished requests")

    assert [len(generated[i]) for i in range(3)] == max_tokens
    iterations = stat_logger.iterations
    assert all(isinstance(scheduler_stats, SchedulerStats) for scheduler_stats, _ in stat_logger.records)
    assert sum(it.num_generation_tokens for it in iterations) == sum(max_tokens)
    assert sum(it.num_prompt_tokens for it in iterations) == sum(len(p) for p in prompts)
    ttfts = [ttft for it in iterations for ttft in it.time_to_first_tokens]
    assert len(ttfts) == 3 and all(ttft > 0 for ttft in ttfts)
    # One token per request per step: every token after a request's first comes with an inter-token latency.
    itls = [itl for it in iterations for itl in it.inter_token_latencies]
    assert len(itls) == sum(max_tokens) - 3 and all(itl >= 0 for itl in itls)
    finished = sorted(stat_logger.finished(), key=lambda f: f.num_prompt_tokens)
    assert [(f.finish_reason, f.num_prompt_tokens, f.num_generation_tokens) for f in finished] == [
        ("length", 3, 5), ("length", 7, 3), ("length", 20, 8)
    ]
    assert all(0 < f.time_to_first_token <= f.e2e_latency for f in finished)


@pytest.mark.anyio
async def test_stop_reasons_and_each_completion_of_n_are_finished_requests(llama):
    async with start_engine(llama) as engine:
        stat_logger = RecordingLogger()
        engine.add_stat_logger(stat_logger)
        with anyio.fail_after(60):
            tokens = await collect_tokens(engine, [7, 8, 9], greedy(6))
            # A synchronous logger has recorded a step before its outputs reach the consumer.
            assert [(f.finish_reason, f.num_generation_tokens) for f in stat_logger.finished()] == [("length", 6)]
            stopped = await collect_tokens(engine, [7, 8, 9], greedy(6, stop_token_ids=[tokens[2]]))
            params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
            outputs = [output async for output in engine.generate(prompt([1, 2, 3, 4]), params)]
    assert outputs[-1].finished and len(stopped) <= 3
    finished = stat_logger.finished()
    assert [(f.finish_reason, f.num_prompt_tokens, f.num_generation_tokens) for f in finished] == [
        ("length", 3, 6), ("stop", 3, len(stopped)), ("length", 4, 4), ("length", 4, 4)
    ]
    # Each completion of n=2 is prefilled on its own, so each counts the prompt.
    assert sum(it.num_prompt_tokens for it in stat_logger.iterations) == 3 + 3 + 4 + 4


@pytest.mark.anyio
async def test_an_aborted_request_finishes_with_reason_abort_even_when_the_engine_goes_idle(llama):
    # The engine is idle after the abort: the periodic task reports it (stats_log_interval).
    async with start_engine(llama, stats_log_interval=0.05) as engine:
        stat_logger = RecordingLogger()
        engine.add_stat_logger(stat_logger)
        received = 0
        with anyio.fail_after(60):
            async with engine.stream(prompt([3, 4, 5]), greedy(LONG)) as outputs:
                async for output in outputs:
                    received += len(output.outputs[0].token_ids)
                    if received >= 3:
                        break
            await wait_for(lambda: stat_logger.finished(), "the abort to be recorded")
    [finished] = stat_logger.finished()
    assert finished.finish_reason == "abort" and finished.num_prompt_tokens == 3
    assert finished.num_generation_tokens >= received and finished.time_to_first_token is not None
    # Tokens of steps still in flight when it was aborted are not counted: it was forgotten.
    assert sum(it.num_generation_tokens for it in stat_logger.iterations) == finished.num_generation_tokens


@pytest.mark.anyio
@pytest.mark.parametrize("logger_cls", [RecordingLogger, AsyncRecordingLogger], ids=["sync", "async"])
async def test_log_is_called_every_stats_log_interval(llama, logger_cls):
    async with start_engine(llama, stats_log_interval=0.05) as engine:
        stat_logger = logger_cls()
        engine.add_stat_logger(stat_logger)
        with anyio.fail_after(30):
            await wait_for(lambda: stat_logger.logs >= 3, "three log() calls")


@pytest.mark.anyio
@pytest.mark.parametrize("method", ["record", "log"])
async def test_a_raising_logger_kills_the_engine_naming_itself(llama, method):
    async with start_engine(llama, stats_log_interval=0.05) as engine:
        engine.add_stat_logger(ExplodingLogger(method))
        with anyio.fail_after(60), pytest.raises(EngineDeadError) as info:
            await collect_tokens(engine, [3, 4, 5], greedy(LONG))
        name = f"{ExplodingLogger.__module__}:{ExplodingLogger.__qualname__}"
        expected = f"stat logger {name} raised in {method}(): RuntimeError: the {method} blew up"
        assert expected in str(info.value)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert not engine.is_running and expected in str(engine.dead_error)
        with pytest.raises(EngineDeadError, match="the " + method + " blew up"):
            await collect_tokens(engine, [3, 4, 5], greedy(2))


def test_a_stat_logger_plugin_is_built_with_the_config_and_a_raising_one_is_a_startup_error():
    config = EngineConfig()
    [stat_logger] = _plugin_stat_loggers([RecordingLogger], config)
    assert isinstance(stat_logger, RecordingLogger) and stat_logger.engine_config is config

    class Broken(StatLoggerBase):
        def __init__(self, engine_config) -> None:
            raise ValueError("no metrics today")

    with pytest.raises(StartupError) as info:
        _plugin_stat_loggers([RecordingLogger, Broken], config)
    assert str(info.value) == (
        f"stat logger plugin {Broken.__module__}:{Broken.__qualname__} raised when constructed: "
        "ValueError: no metrics today"
    )


def test_stats_log_interval_must_be_positive():
    from asyncengine.errors import ConfigError

    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="stats_log_interval must be > 0") as info:
            EngineConfig(stats_log_interval=bad)
        assert info.value.field == "stats_log_interval"


def test_the_blocking_llm_delivers_stats_to_a_logger_added_from_the_callers_thread(make_llm, llama):
    llm = make_llm(str(llama.path), **ENGINE_OPTIONS)
    stat_logger = RecordingLogger()
    llm.engine.add_stat_logger(stat_logger)  # runs on the engine's event-loop thread
    outputs = llm.generate([prompt([1, 2, 3]), prompt([4, 5, 6, 7])], greedy(5))
    assert [len(output.outputs[0].token_ids) for output in outputs] == [5, 5]
    finished = sorted(stat_logger.finished(), key=lambda f: f.num_prompt_tokens)
    assert [(f.finish_reason, f.num_prompt_tokens, f.num_generation_tokens) for f in finished] == [
        ("length", 3, 5), ("length", 4, 5)
    ]
    assert sum(it.num_generation_tokens for it in stat_logger.iterations) == 10


# -- StatsTracker on its own -----------------------------------------------------------------------------


def core_request(request_id: str, prompt_len: int, arrival: float) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=list(range(prompt_len)), sampling=SamplingOptions(),
        arrival_time=arrival,
    )


def core_output(request_id: str, tokens: list[int], finish_reason: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=request_id, new_token_ids=tokens, finish_reason=finish_reason)


def test_the_tracker_follows_requests_from_arrival_to_finish_and_forgets_them():
    tracker = StatsTracker()
    tracker.add_requests([core_request("a", 3, arrival=10.0), core_request("b", 2, arrival=10.5)])
    first = tracker.step([core_output("a", [7]), core_output("b", [])], now=11.0)  # b still prefilling
    assert (first.num_prompt_tokens, first.num_generation_tokens) == (3, 1)
    assert (first.time_to_first_tokens, first.inter_token_latencies, first.finished_requests) == ([1.0], [], [])

    second = tracker.step([core_output("a", [8, 9]), core_output("b", [4])], now=11.5)
    assert (second.num_prompt_tokens, second.num_generation_tokens) == (2, 3)
    assert (second.time_to_first_tokens, second.inter_token_latencies) == ([1.0], [0.5])

    # a ends in the engine core; a stop string ends b in the frontend.
    third = tracker.step([core_output("a", [1], "length"), core_output("b", [5])], now=12.0,
                         stopped_in_frontend=["b"])
    # Fed without admitted ids, a request counts as scheduled by the step that brought its first token.
    assert third.finished_requests == [
        FinishedRequestStats(finish_reason="length", e2e_latency=2.0, num_prompt_tokens=3, num_generation_tokens=4,
                             time_to_first_token=1.0, queued_time=1.0, prefill_time=0.0, decode_time=1.0,
                             inference_time=1.0, max_tokens=16),
        FinishedRequestStats(finish_reason="stop", e2e_latency=1.5, num_prompt_tokens=2, num_generation_tokens=2,
                             time_to_first_token=1.0, queued_time=1.0, prefill_time=0.0, decode_time=0.5,
                             inference_time=0.5, max_tokens=16),
    ]
    assert (first.n_params, third.max_num_generation_tokens) == ([2], [4])  # one prompt with two requests
    assert len(tracker) == 0
    # b's tokens from a step already in flight when it was told to stop count for nothing.
    assert tracker.step([core_output("b", [6])], now=12.5).is_empty


def test_the_tracker_times_queue_prefill_and_decode_from_the_admitting_step():
    tracker = StatsTracker()
    tracker.add_requests([core_request("a", 40, arrival=10.0)])
    # The step that admitted a began 0.5 s before its outputs arrived at 12.0; a chunked prefill: no token yet.
    tracker.step([core_output("a", [])], now=12.0, admitted=["a"], step_seconds=0.5)
    tracker.step([core_output("a", [1])], now=13.0, admitted=["a"], step_seconds=0.5)  # listed again: ignored
    done = tracker.step([core_output("a", [2], "length")], now=14.5)
    (finished,) = done.finished_requests
    assert (finished.queued_time, finished.prefill_time, finished.decode_time, finished.inference_time) == \
        (1.5, 1.5, 1.5, 3.0)
    assert finished.e2e_latency == finished.queued_time + finished.inference_time
    # A step time longer than the request has lived (clock skew, rounding) never makes a phase negative.
    tracker.add_requests([core_request("b", 2, arrival=20.0)])
    (late,) = tracker.step([core_output("b", [1], "stop")], now=20.1, admitted=["b"], step_seconds=5.0) \
        .finished_requests
    assert (late.queued_time, late.prefill_time, late.decode_time) == (0.0, pytest.approx(0.1), 0.0)


def test_the_tracker_reports_aborts_with_the_next_stats_and_forgets_them():
    tracker = StatsTracker()
    tracker.add_requests([core_request("a", 4, arrival=1.0), core_request("b", 2, arrival=1.0)])
    tracker.step([core_output("a", [1])], now=2.0)
    tracker.abort(["a", "b", "never-sent"], now=3.0)
    assert len(tracker) == 0
    stats = tracker.take_pending()
    assert stats.finished_requests == [
        FinishedRequestStats(finish_reason="abort", e2e_latency=2.0, num_prompt_tokens=4, num_generation_tokens=1,
                             time_to_first_token=1.0, queued_time=1.0, decode_time=1.0, inference_time=1.0,
                             max_tokens=16),
        # Never scheduled: it waited all its life.
        FinishedRequestStats(finish_reason="abort", e2e_latency=2.0, num_prompt_tokens=2, num_generation_tokens=0,
                             time_to_first_token=None, queued_time=2.0, max_tokens=16),
    ]
    assert tracker.take_pending() is None

    tracker.add_requests([core_request("c", 1, arrival=4.0)])
    tracker.abort(["c"], now=5.0)
    next_step = tracker.step([core_output("a", [2])], now=6.0)  # a's late tokens: ignored
    assert [f.finish_reason for f in next_step.finished_requests] == ["abort"]
    assert next_step.num_generation_tokens == 0 and tracker.take_pending() is None
