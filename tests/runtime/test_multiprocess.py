"""The engine core and the workers in processes of their own: placement, shutdown, and death.

- in_process=False with the "uni" (worker in a thread of the engine-core process) and "mp" (one
  worker process) executors serves the same greedy outputs as the in-process engine, reports worker
  errors to the caller and keeps serving, and leaves no process behind when the `async with` ends;
- a worker or the engine core killed with SIGKILL mid-generation: every waiting caller gets an
  EngineDeadError naming the process and the signal within 5 s, new requests are refused at once,
  shutting down is prompt, and no engine process survives.

Process checks read /proc: a pid whose /proc entry is gone, or is a zombie (dead, waiting to be reaped;
orphans are re-parented to this sandbox's pid 1, which may never reap them), is no longer running.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import anyio
import pytest

from asyncengine import LLM, AsyncEngine, EngineDeadError, SamplingParams
from asyncengine.errors import RequestError, WorkerError
from support.engine_checks import assert_all_blocks_free

pytestmark = pytest.mark.anyio

PROMPTS = [[5, 6, 7], list(range(100, 140)), [900, 3, 41, 77, 12], list(range(300, 317))]
NUM_TOKENS = 16


@pytest.fixture
def anyio_backend(request):
    """trio only (process handling is the same on both backends), with the event-loop guard."""
    from support.loop_guard import LoopBlockingGuard

    guard = LoopBlockingGuard()
    request.node.loop_guard = guard
    return ("trio", {"instruments": [guard]})


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


OPTIONS = dict(skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20)


@pytest.fixture(scope="module")
def in_process_outputs(llama) -> list[list[int]]:
    """Each prompt alone, greedy, on the default placement (in-process engine core, worker thread)."""
    with LLM(str(llama.path), **OPTIONS) as llm:
        return [llm.generate(prompt(p), greedy(NUM_TOKENS))[0].outputs[0].token_ids for p in PROMPTS]


def start_engine(model, **overrides) -> AsyncEngine:
    return AsyncEngine.start(model=str(model.path), **{**OPTIONS, **overrides})


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompt(token_ids: list[int]) -> dict:
    return {"prompt_token_ids": list(token_ids)}


# -- the process table -----------------------------------------------------------------------------------


def process_state(pid: int) -> str | None:
    """The one-letter state from /proc/<pid>/stat (R, S, Z, ...), or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rpartition(")")[2].split()[0]  # the name in parentheses may contain spaces


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def is_running(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")


async def wait_not_running(pids: list[int], timeout: float, *, reaped: bool = False) -> None:
    """Wait until none of `pids` runs (with `reaped`: until they have left the process table)."""
    deadline = time.monotonic() + timeout
    while True:
        states = {pid: process_state(pid) for pid in pids}
        if all(state is None if reaped else state in (None, "Z", "X") for state in states.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engine processes left after {timeout} s (pid: state): {states}")
        await anyio.sleep(0.05)


async def wait_until_idle(engine: AsyncEngine, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.get_scheduler_stats()
        if (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the scheduler did not drain within {timeout} s: {stats}")
        await anyio.sleep(0.02)


async def generate_all(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    results: dict[int, list[int]] = {}

    async def one(index: int) -> None:
        tokens: list[int] = []
        async for output in engine.generate(prompt(prompts[index]), params):
            tokens += output.outputs[0].token_ids
        results[index] = tokens

    async with anyio.create_task_group() as tg:
        for index in range(len(prompts)):
            tg.start_soon(one, index)
    return [results[index] for index in range(len(prompts))]


# -- placement -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["uni", "mp"])
async def test_engine_core_in_its_own_process(llama, in_process_outputs, backend):
    with anyio.fail_after(120):
        async with start_engine(llama, in_process=False, distributed_executor_backend=backend) as engine:
            core_pid = engine._core.process.pid
            assert core_pid != os.getpid() and parent_pid(core_pid) == os.getpid()
            (worker,) = await engine.collective_rpc("describe")
            assert (worker["rank"], worker["world_size"]) == (0, 1)
            if backend == "uni":
                assert worker["pid"] == core_pid  # a thread of the engine-core process
            else:
                assert worker["pid"] not in (core_pid, os.getpid())
                assert parent_pid(worker["pid"]) == core_pid
            engine_pids = sorted({core_pid, worker["pid"]})
            assert all(is_running(pid) for pid in engine_pids)

            assert await generate_all(engine, PROMPTS, greedy(NUM_TOKENS)) == in_process_outputs

            # A worker method that raises (here: one that does not exist, or bad arguments) is the
            # caller's error, typed and named; the engine keeps serving.
            with pytest.raises(WorkerError, match="no_such_method"):
                await engine.collective_rpc("no_such_method")
            with pytest.raises(WorkerError, match="describe"):
                await engine.collective_rpc("describe", [1])
            with pytest.raises(RequestError, match="only public methods") as refused:
                await engine.collective_rpc("_private")  # refused before any worker is involved
            assert refused.value.field == "method"
            # The error names the worker: its rank and process, or the engine-core process it is a thread of.
            with pytest.raises(WorkerError) as info:
                await engine.collective_rpc("no_such_method")
            if backend == "mp":
                assert f"worker rank 0 (pid {worker['pid']})" in str(info.value), str(info.value)
            else:
                assert f"the worker (a thread of the engine core (pid {core_pid}))" in str(info.value), str(info.value)
            assert engine.is_running
            assert await generate_all(engine, PROMPTS[:2], greedy(NUM_TOKENS)) == in_process_outputs[:2]
            assert_all_blocks_free(await wait_until_idle(engine))
            leaving = time.monotonic()
    assert time.monotonic() - leaving < 15
    await wait_not_running(engine_pids, timeout=5, reaped=True)


async def test_uni_worker_errors_name_the_worker(llama):
    """WorkerError names the worker (errors.py) on the in-process thread too, as the mp executor does."""
    async with start_engine(llama, distributed_executor_backend="uni") as engine:
        with pytest.raises(WorkerError, match=r"the worker \(a thread of .*\).*no_such_method"):
            await engine.collective_rpc("no_such_method")
        with pytest.raises(WorkerError, match=r"the worker \(a thread of .*\): TypeError: .*describe"):
            await engine.collective_rpc("describe", [1])
        (worker,) = await engine.collective_rpc("describe")
        assert worker["pid"] == os.getpid()


# -- death -----------------------------------------------------------------------------------------------


async def kill_mid_generation(engine: AsyncEngine, pid: int, *, num_streams: int = 4) -> list[EngineDeadError]:
    """Run `num_streams` long streams; once each has tokens, SIGKILL `pid`. Each stream must fail with
    EngineDeadError within 5 s of the kill; returns the errors."""
    progress = [0] * num_streams
    all_streaming = anyio.Event()
    failures: dict[int, tuple[float, EngineDeadError]] = {}
    finished: list[int] = []

    async def stream(index: int) -> None:
        try:
            async for output in engine.generate(prompt(PROMPTS[index % len(PROMPTS)]), greedy(400)):
                progress[index] += len(output.outputs[0].token_ids)
                if min(progress) >= 2:
                    all_streaming.set()
        except EngineDeadError as error:
            failures[index] = (time.monotonic(), error)
        else:
            finished.append(index)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for index in range(num_streams):
                tg.start_soon(stream, index)
            await all_streaming.wait()
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
    assert finished == [], "a stream finished normally although a process died under it"
    assert sorted(failures) == list(range(num_streams))
    for when, error in failures.values():
        assert when - killed_at < 5.0, f"an EngineDeadError came {when - killed_at:.1f} s after the kill"
    return [error for _, error in failures.values()]


async def assert_refuses_at_once(engine: AsyncEngine) -> None:
    assert not engine.is_running and isinstance(engine.dead_error, EngineDeadError)
    with anyio.fail_after(1):
        with pytest.raises(EngineDeadError):
            await engine.generate(prompt([1, 2, 3]), greedy(2)).__anext__()
        with pytest.raises(EngineDeadError):
            await engine.collective_rpc("describe")
        with pytest.raises(EngineDeadError):
            await engine.get_scheduler_stats()


@pytest.mark.parametrize("in_process", [False, True], ids=["core-process", "core-in-process"])
async def test_a_killed_worker_fails_every_caller(llama, in_process):
    with anyio.fail_after(120):
        async with start_engine(llama, in_process=in_process, distributed_executor_backend="mp") as engine:
            core_pid = os.getpid() if in_process else engine._core.process.pid
            (worker,) = await engine.collective_rpc("describe")
            worker_pid = worker["pid"]
            assert worker_pid not in (core_pid, os.getpid())
            errors = await kill_mid_generation(engine, worker_pid)
            for error in errors:
                message = str(error)
                assert f"worker rank 0 (pid {worker_pid})" in message and "SIGKILL" in message, message
                if not in_process:
                    assert f"engine core (pid {core_pid})" in message, message
            await assert_refuses_at_once(engine)
            leaving = time.monotonic()
    assert time.monotonic() - leaving < 10, "leaving the engine took too long after the worker died"
    pids = [worker_pid] if in_process else [worker_pid, core_pid]
    await wait_not_running(pids, timeout=5)


@pytest.mark.parametrize("backend", ["uni", "mp"])
async def test_a_killed_engine_core_fails_every_caller(llama, backend):
    with anyio.fail_after(120):
        async with start_engine(llama, in_process=False, distributed_executor_backend=backend) as engine:
            core_pid = engine._core.process.pid
            (worker,) = await engine.collective_rpc("describe")
            errors = await kill_mid_generation(engine, core_pid)
            for error in errors:
                message = str(error)
                assert f"engine core (pid {core_pid})" in message and "SIGKILL" in message, message
            await assert_refuses_at_once(engine)
            leaving = time.monotonic()
    assert time.monotonic() - leaving < 10, "leaving the engine took too long after the engine core died"
    # The engine core is reaped by us; its worker process (mp) notices its parent is gone and exits.
    await wait_not_running(sorted({core_pid, worker["pid"]}), timeout=5)
