"""StatLogging: an `async def record` logger runs in a task of its own behind a bounded buffer, so a slow
one does not hold back the streams; what it cannot take is dropped, counted and reported once per
interval; its task ends with the engine. And `wait_dead()`, the engine's death as an event.

An in-process engine on the tiny Llama (token-id prompts), on trio and asyncio.
"""

from __future__ import annotations

import logging
import time

import anyio
import pytest

from asyncengine import AsyncEngine, EngineDeadError, SamplingParams
from asyncengine.interfaces.stat_logger import StatLoggerBase
from asyncengine.frontend.stat_logging import RECORD_BUFFER

ENGINE_OPTIONS = dict(skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20)
NUM_STREAMS, MAX_TOKENS = 4, 200  # about 200 steps: far more than the slow logger's buffer holds


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")


class CountingLogger(StatLoggerBase):
    """Plain `record`: called in the output handler, once per step (the count of steps produced)."""

    def __init__(self) -> None:
        super().__init__()
        self.records = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.records += 1


class SlowLogger(StatLoggerBase):
    """A second per record, as a logger waiting on a slow network would take."""

    def __init__(self) -> None:
        super().__init__()
        self.started = 0
        self.cancelled = False

    async def record(self, scheduler_stats, iteration_stats) -> None:
        self.started += 1
        try:
            await anyio.sleep(1.0)
        except anyio.get_cancelled_exc_class():
            self.cancelled = True
            raise


class ExplodingLogger(StatLoggerBase):
    async def record(self, scheduler_stats, iteration_stats) -> None:
        raise RuntimeError("the record blew up")


async def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await anyio.sleep(0.02)


@pytest.mark.anyio
async def test_a_slow_async_logger_does_not_hold_back_the_streams_and_its_drops_are_counted(llama, caplog):
    slow, counting = SlowLogger(), CountingLogger()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    caplog.set_level(logging.WARNING, logger="asyncengine.frontend.stat_logging")
    async with AsyncEngine.start(model=str(llama.path), stats_log_interval=0.2, **ENGINE_OPTIONS) as engine:
        engine.add_stat_logger(slow)
        engine.add_stat_logger(counting)
        tokens = [0] * NUM_STREAMS

        async def run(index: int) -> None:
            async for output in engine.generate({"prompt_token_ids": [3 + index, 4, 5]}, params):
                tokens[index] += len(output.outputs[0].token_ids)

        # Recorded inline, the slow logger would take a second per step: some 200 s.
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for index in range(NUM_STREAMS):
                    tg.start_soon(run, index)
        assert tokens == [MAX_TOKENS] * NUM_STREAMS
        produced, started = counting.records, slow.started
        assert produced >= MAX_TOKENS and started < produced
        # Each step's stats went to the slow logger, wait in its buffer, or were dropped.
        dropped = engine.stat_logging.num_dropped
        assert dropped >= produced - started - RECORD_BUFFER > 0
        assert engine.stat_logging.dropped_records() == {f"{__name__}:SlowLogger": dropped}
        # Reported once per interval in the log, not once per drop.
        await wait_for(lambda: any("fell behind" in r.getMessage() for r in caplog.records), "the drop report")
        reports = [r.getMessage() for r in caplog.records if "fell behind" in r.getMessage()]
        assert 0 < len(reports) < dropped
        assert all(f"{__name__}:SlowLogger" in report for report in reports)
        assert not slow.cancelled
    # Its task belonged to the engine: leaving the engine cancelled the record it was in.
    assert slow.cancelled


@pytest.mark.anyio
async def test_wait_dead_returns_the_error_once_the_engine_dies(llama):
    async with AsyncEngine.start(model=str(llama.path), **ENGINE_OPTIONS) as engine:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                died: list[EngineDeadError] = []

                async def watch() -> None:
                    died.append(await engine.wait_dead())

                tg.start_soon(watch)
                await anyio.sleep(0.05)
                assert not died  # alive: it waits
                engine.add_stat_logger(ExplodingLogger())
                with pytest.raises(EngineDeadError):
                    async for _ in engine.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=50)):
                        pass
        [error] = died
        assert error is engine.dead_error and "the record blew up" in str(error)
        assert await engine.wait_dead() is error  # at once, now that it is dead
