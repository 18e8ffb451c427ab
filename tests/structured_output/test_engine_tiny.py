"""Structured outputs in a whole engine on the tiny Llama with the tiny byte-level tokenizer (random
weights: whatever it writes inside a constraint, it writes only because of the masks).

- a request whose grammar is still compiling waits without holding up an unconstrained one;
- requests with the same grammar share one compilation; a refused grammar is a RequestError naming the
  field and the backend, and the engine serves on;
- a grammar that cannot finish within max_tokens ends with "length".
"""

from __future__ import annotations

import re
import shutil
import threading

import anyio
import pytest

from asyncengine import AsyncEngine, EngineConfig, RequestError, SamplingParams, StructuredOutputsParams
from asyncengine.interfaces.structured_output import StructuredOutputBackendRegistry
from asyncengine.structured_output.xgrammar_backend import XgrammarBackend
from support.tiny_tokenizer import save_tiny_tokenizer

OPTIONS = dict(max_model_len=256, kv_cache_memory_bytes=8 * 2**20, plugins="")

# The slow backend's compile waits for this; a test sets it once it has seen what it needs meanwhile.
release_compile = threading.Event()


class GatedBackend(XgrammarBackend):
    """xgrammar whose compilation waits until the test releases it."""

    def compile(self, spec):
        if not release_compile.wait(timeout=300):
            raise ValueError("the test never released the compilation")
        return super().compile(spec)


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("so-tiny") / "model"
    shutil.copytree(tiny_model("llama").path, directory)
    save_tiny_tokenizer(directory)
    return str(directory)


async def collect(engine, prompt, params):
    text, token_ids, finish = "", [], None
    async for out in engine.generate(prompt, params):
        completion = out.outputs[0]
        text += completion.text
        token_ids += completion.token_ids
        finish = completion.finish_reason or finish
    return text, token_ids, finish


@pytest.mark.anyio
async def test_a_compiling_grammar_holds_up_only_its_own_request(model_dir, monkeypatch):
    # (on a copy of the entries: a later module's engine-core process would find the key in this process's
    # manifest and fail its start-up for lacking it)
    monkeypatch.setattr(StructuredOutputBackendRegistry, "_entries", dict(StructuredOutputBackendRegistry._entries))
    StructuredOutputBackendRegistry.register("gated_test_backend", GatedBackend, override=True)
    release_compile.clear()
    gated = SamplingParams(temperature=0, max_tokens=16,
                           structured_outputs=StructuredOutputsParams(regex="[a-c]{4}x", backend="gated_test_backend"))
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = {}
    async with AsyncEngine.start(EngineConfig(model=model_dir, **OPTIONS)) as engine:
        async def run(name, params):
            results[name] = await collect(engine, "hello", params)

        with anyio.fail_after(300):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "gated", gated)
                await anyio.sleep(0.2)  # the gated request is in the engine core, compiling
                await run("plain", plain)
                # The unconstrained request finished while the grammar was still compiling.
                assert "gated" not in results
                release_compile.set()
    assert len(results["plain"][1]) == 8
    text, _, finish = results["gated"]
    assert re.fullmatch("[a-c]{4}x", text) and finish == "stop", results["gated"]


@pytest.mark.anyio
async def test_one_compilation_is_shared_and_a_refused_grammar_is_a_request_error(model_dir):
    regex = StructuredOutputsParams(regex="(yes|no)[0-9]{2}")
    async with AsyncEngine.start(EngineConfig(model=model_dir, **OPTIONS)) as engine:
        with anyio.fail_after(300):
            results = []

            async def run(seed):
                results.append(await collect(engine, "q", SamplingParams(temperature=1.0, seed=seed, max_tokens=16,
                                                                          structured_outputs=regex)))

            async with anyio.create_task_group() as tg:
                for seed in range(4):
                    tg.start_soon(run, seed)
            for backend in ("xgrammar", "guidance"):
                with pytest.raises(RequestError) as refused:
                    await collect(engine, "q", SamplingParams(
                        structured_outputs=StructuredOutputsParams(json='{"type": "object", "minProperties": "x"}',
                                                                   backend=backend)))
                assert refused.value.field == "structured_outputs.json"
                assert f"backend {backend!r}" in refused.value.message
            with pytest.raises(RequestError) as refused:
                await collect(engine, "q", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a")))
            assert refused.value.field == "structured_outputs.regex" and "'xgrammar'" in refused.value.message
            stats = await engine.call_engine_core("get_structured_output_stats")
    assert all(re.fullmatch("(yes|no)[0-9]{2}", text) and finish == "stop" for text, _, finish in results), results
    assert stats["num_compiled"] == 1 and stats["num_cache_hits"] == 3, stats
    assert stats["requests_per_backend"] == {"xgrammar": 4} and stats["running_backends"] == {}, stats


@pytest.mark.anyio
async def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(model_dir):
    async with AsyncEngine.start(EngineConfig(model=model_dir, **OPTIONS)) as engine:
        with anyio.fail_after(300):
            text, token_ids, finish = await collect(engine, "q", SamplingParams(
                temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(regex="z{40}")))
    assert finish == "length" and text == "z" * 6 and len(token_ids) == 6


@pytest.mark.anyio
async def test_with_async_scheduling_constrained_requests_decode_in_one_step_not_alternating_halves(model_dir):
    # Four constrained requests whose prefills land in different steps (64 tokens a step, 40-token prompts).
    # A constrained request waits for its own token before its next step; if the ready ones were scheduled
    # meanwhile, the four would split into two groups alternating steps, each step carrying half of them
    # (what halved bench/structured.py's W3 figure). Held back together, they decode four to a step.
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex="z{30}"))
    # (1 MiB of KV cache: the engine core builds its blocks on the event loop, test_reasoning.py says why)
    config = EngineConfig(model=model_dir, async_scheduling=True, max_num_batched_tokens=64,
                          **{**OPTIONS, "kv_cache_memory_bytes": 2**20})
    async with AsyncEngine.start(config) as engine:
        with anyio.fail_after(300):
            await collect(engine, "warm", params)  # the grammar compiled, so that all four start together
            await engine.call_engine_core("start_step_trace")
            results = []

            async def run(index):
                results.append(await collect(engine, f"{index}" * 40, params))

            async with anyio.create_task_group() as tg:
                for index in range(4):
                    tg.start_soon(run, index)
            trace = await engine.call_engine_core("stop_step_trace")
    assert all(text == "z" * 30 for text, _, _ in results), results
    sizes = [record[1] for record in trace]  # StepRecord's num_tokens: one per decoding request
    # 160 prompt tokens take 3 steps, the 4 x 30 tokens then about 30 steps of 4 (not about 60 of 2).
    assert sizes.count(4) >= 25 and len(sizes) <= 40, sizes


SPLIT_STEP_CASES = {  # name: (async scheduling, executor options)
    "async-uni": (True, {}),
    "sync-uni": (False, {}),
    # two worker processes: each rank's process gets the masks in a GrammarMasks frame (worker/process.py)
    "async-mp-tp2": (True, {"distributed_executor_backend": "mp", "tensor_parallel_size": 2}),
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", sorted(SPLIT_STEP_CASES))
async def test_constrained_masks_follow_their_step_so_steps_overlap(model_dir, case, anyio_backend):
    # Split step (structured_output/deferred.py): with async scheduling the next step of constrained
    # requests is scheduled and submitted before the step in flight is folded in (its masks follow it),
    # so decode steps overlap as unconstrained ones do; without it, one step at a time. Same tokens either
    # way (the random model writes the pattern only because of the masks).
    async_scheduling, executor_options = SPLIT_STEP_CASES[case]
    if executor_options and anyio_backend != "trio":
        pytest.skip("worker processes: the trio run covers them (the executor is the same on asyncio)")
    params = SamplingParams(temperature=0, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(regex="(ab|ba)[xyz]{10}(q|r){12}"))
    config = EngineConfig(model=model_dir, async_scheduling=async_scheduling, **OPTIONS, **executor_options)
    async with AsyncEngine.start(config) as engine:
        with anyio.fail_after(300):
            await collect(engine, "warm", params)  # compiled, so that all three start together
            await engine.call_engine_core("start_step_trace")
            results = {}

            async def run(index):
                results[index] = await collect(engine, f"prompt {index}", params)

            async with anyio.create_task_group() as tg:
                for index in range(3):
                    tg.start_soon(run, index)
            trace = await engine.call_engine_core("stop_step_trace")
            stats = await engine.call_engine_core("get_structured_output_stats")
    assert all(re.fullmatch("(ab|ba)[xyz]{10}(q|r){12}", text) and finish == "stop"
               for text, _, finish in results.values()), results
    # StepRecord: (step, num_tokens, schedule_start, schedule_end, execute_start, execute_end, ...)
    overlapped = sum(1 for before, after in zip(trace, trace[1:]) if after[2] < before[5])
    if async_scheduling:
        assert overlapped >= len(trace) // 2, (overlapped, len(trace))
    else:
        assert overlapped == 0, trace
    assert stats["num_masks"] >= 3 * 24, stats  # every constrained token was masked, deferred or not
