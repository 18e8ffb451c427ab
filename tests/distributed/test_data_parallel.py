"""Data parallelism: two engine cores (each in its own process, each with its own worker and KV cache)
behind one frontend; the API of `serve` over it through Quart's test client (no server process needed:
the engine cores are the processes that matter).

The router's choices are tested on their own; then one DP=2 engine for the module: 64 concurrent
requests equal DP=1's outputs and both engine cores computed prompts (per-engine counters of /metrics);
then SIGKILL of one engine core fails its requests alone, the other serves on (/metrics: its engine_up 0
and its gauges 0, never stale), and only the death of the last one kills the engine.
"""

from __future__ import annotations

import functools
import os
import random
import re
import signal
from contextlib import asynccontextmanager

import anyio
import pytest
from anyio.from_thread import start_blocking_portal

from asyncengine import AsyncEngine, EngineDeadError, SamplingParams
from asyncengine.frontend.dp_router import AFFINITY_SLACK, Router, combine
from asyncengine.server.app import create_app
from asyncengine.server.config import ServerConfig

OPTIONS = dict(skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=8 * 2**20)
NUM_REQUESTS = 64


# -- the router, alone ---------------------------------------------------------------------------------


def test_router_picks_the_least_loaded_then_lower_kv_usage():
    router = Router(3, block_size=4)
    router.loads = [2, 1, 1]
    router.kv_usage = [0.0, 0.5, 0.2]
    assert router.choose([1, 2]) == 2  # loads tie between 1 and 2: the lower KV usage
    router.alive[2] = False
    assert router.choose([1, 2]) == 1  # a dead engine core gets nothing
    router.alive = [False, False, False]
    with pytest.raises(EngineDeadError, match="every data-parallel engine core is dead"):
        router.choose([1, 2])


def test_router_keeps_a_prefix_on_its_engine_within_the_slack():
    router = Router(2, block_size=4)
    prompt = [5, 6, 7, 8, 9]
    assert router.choose(prompt) == 0
    router.loads = [AFFINITY_SLACK, 0]
    assert router.choose(prompt + [10]) == 0  # same first block, engine 0 within the slack: its cache has it
    assert router.choose([1, 2, 3, 4]) == 1  # another first block: the least loaded
    router.loads = [AFFINITY_SLACK + 1, 0]
    assert router.choose(prompt) == 1  # past the slack: the least loaded, and the block moves there
    router.loads = [0, 0]
    assert router.choose(prompt) == 1
    assert router.choose([5, 6]) == 0  # shorter than a block: no affinity


def test_scheduler_stats_combine_into_a_sum_with_each_engine():
    stats = [{"num_running_reqs": 2, "num_waiting_reqs": 1, "kv_cache_usage": 0.5, "num_prompt_tokens_computed": 7,
              "expert_tokens": [4, 0, 2], "spec_decode_num_drafts": 3, "spec_decode_num_accepted_tokens_per_pos": [2, 1],
              "encoder_cache_entries": 2, "encoder_cache_rows": 32},
             {"num_running_reqs": 3, "num_waiting_reqs": 0, "kv_cache_usage": 0.25, "num_prompt_tokens_computed": 5,
              "expert_tokens": [1, 1, 0], "spec_decode_num_drafts": 2, "spec_decode_num_accepted_tokens_per_pos": [1, 0],
              "encoder_cache_entries": 1, "encoder_cache_rows": 16}]
    total = combine("get_scheduler_stats", stats, [0, 1])
    assert (total["num_running_reqs"], total["num_waiting_reqs"], total["num_prompt_tokens_computed"]) == (5, 1, 12)
    assert total["expert_tokens"] == [5, 1, 2]  # a MoE model's tokens per expert, expert by expert
    assert (total["spec_decode_num_drafts"], total["spec_decode_num_accepted_tokens_per_pos"]) == (5, [3, 1])
    assert total["kv_cache_usage"] == pytest.approx(0.375)
    assert (total["encoder_cache_entries"], total["encoder_cache_rows"]) == (3, 48)  # images held, on both engines
    assert [e["engine_index"] for e in total["engines"]] == [0, 1]
    assert combine("collective_rpc", [[{"rank": 0}], [{"rank": 0}]], [0, 1]) == [{"rank": 0}, {"rank": 0}]


# -- one DP=2 engine for the module --------------------------------------------------------------------


class Served:
    """The DP=2 engine and the app over it, driven from plain tests through a blocking portal."""

    def __init__(self, portal, engine, client) -> None:
        self.portal = portal
        self.engine = engine
        self.client = client

    def get(self, path: str) -> tuple[int, str]:
        async def get() -> tuple[int, str]:
            response = await self.client.get(path)
            return response.status_code, (await response.get_data()).decode()

        return self.portal.call(get)

    def run(self, function, *args):
        return self.portal.call(functools.partial(function, self.engine, *args))


@asynccontextmanager
async def serving(options):
    async with AsyncEngine.start(**options) as engine:
        app = create_app(engine, ServerConfig())
        async with app.test_app() as running:
            yield engine, running.test_client()


@pytest.fixture(scope="module")
def dp2(tiny_model):
    model = tiny_model("llama")
    with start_blocking_portal("trio") as portal:
        options = dict(model=str(model.path), data_parallel_size=2, in_process=False, **OPTIONS)
        with portal.wrap_async_context_manager(serving(options)) as (engine, client):
            yield Served(portal, engine, client)


def prompts_for(vocab_size: int) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, 48))] for _ in range(NUM_REQUESTS)]


async def generate_all(engine, prompts, params) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in prompts]

    async def one(index: int) -> None:
        async for output in engine.generate({"prompt_token_ids": prompts[index]}, params):
            results[index].extend(output.outputs[0].token_ids)

    async with anyio.create_task_group() as tg:
        for index in range(len(prompts)):
            tg.start_soon(one, index)
    return results


def per_engine(metrics: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{re.escape(name)}{{engine="(\d+)",model_name="[^"]*"}} (\S+)$', metrics, re.M)}


def test_dp2_serves_64_concurrent_requests_on_both_engines_as_dp1(dp2, tiny_model, make_llm):
    model = tiny_model("llama")
    prompts = prompts_for(model.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in
                 make_llm(str(model.path), **OPTIONS).generate([{"prompt_token_ids": p} for p in prompts], params)]

    # Two engine cores, each its own process (the worker is a thread of it: describe's pid is the core's).
    pids = [d["pid"] for d in dp2.run(lambda engine: engine.collective_rpc("describe"))]
    assert len(set(pids)) == 2 and os.getpid() not in pids

    assert dp2.run(generate_all, prompts, params) == reference

    status, metrics = dp2.get("/metrics")
    assert status == 200
    computed = per_engine(metrics, "asyncengine:prompt_tokens_computed_total")
    assert set(computed) == {"0", "1"}, metrics
    assert all(value > 0 for value in computed.values()), computed  # both engine cores computed prompts
    assert sum(computed.values()) == sum(len(p) for p in prompts)
    assert set(per_engine(metrics, "asyncengine:num_requests_running")) == {"0", "1"}
    assert per_engine(metrics, "asyncengine:engine_up") == {"0": 1.0, "1": 1.0}


def test_killing_one_engine_core_fails_its_requests_and_the_other_serves_on(dp2, tiny_model):
    model = tiny_model("llama")
    prompts = prompts_for(model.vocab_size)
    long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    pids = [d["pid"] for d in dp2.run(lambda engine: engine.collective_rpc("describe"))]

    async def kill_engine_one_mid_generation(engine) -> tuple[int, list[str], str]:
        finished, failures = 0, []
        first_outputs = 0
        got_first = anyio.Event()

        async def one(prompt) -> None:
            nonlocal finished, first_outputs
            try:
                async for output in engine.generate({"prompt_token_ids": prompt}, long):
                    if first_outputs < NUM_REQUESTS:
                        first_outputs += 1
                        if first_outputs == 8:
                            got_first.set()
                    if output.finished:
                        finished += 1
            except EngineDeadError as error:
                failures.append(str(error))

        with anyio.fail_after(240):
            async with anyio.create_task_group() as tg:
                for prompt in prompts:
                    tg.start_soon(one, prompt)
                await got_first.wait()
                before = await dp2.client.get("/metrics")  # engine core 1's gauges while it runs requests
                os.kill(pids[1], signal.SIGKILL)
        return finished, failures, (await before.get_data()).decode()

    finished, failures, metrics_before = dp2.run(kill_engine_one_mid_generation)
    assert per_engine(metrics_before, "asyncengine:num_requests_running")["1"] > 0
    assert failures and finished, (finished, failures)  # some requests were on each engine core
    assert finished + len(failures) == NUM_REQUESTS
    assert all("data-parallel engine core 1" in text for text in failures), failures[0]
    # The engine lives on: reported, healthy, and new requests go to engine core 0.
    assert dp2.engine.dead_error is None
    assert [lost.engine_index for lost in dp2.engine._core.lost] == [1]
    assert dp2.get("/health")[0] == 200
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert [len(t) for t in dp2.run(generate_all, prompts[:4], short)] == [4] * 4
    # /metrics says which engine core is gone, and shows nothing running there (its gauges never stay stale).
    status, metrics = dp2.get("/metrics")
    assert status == 200
    assert per_engine(metrics, "asyncengine:engine_up") == {"0": 1.0, "1": 0.0}
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert per_engine(metrics, f"asyncengine:{gauge}")["1"] == 0, (gauge, metrics)
    assert per_engine(metrics, "asyncengine:prompt_tokens_computed_total")["1"] > 0  # counters keep their totals

    # The last engine core's death is the engine's.
    os.kill(pids[0], signal.SIGKILL)

    async def wait_dead(engine) -> str:
        with anyio.fail_after(30):
            return str(await engine.wait_dead())

    assert "data-parallel engine core 0" in dp2.run(wait_dead)
    async def generate_one(engine) -> None:
        async for _ in engine.generate({"prompt_token_ids": prompts[0]}, short):
            pass

    with pytest.raises(EngineDeadError):
        dp2.run(generate_one)
    assert dp2.get("/health")[0] == 503
    assert per_engine(dp2.get("/metrics")[1], "asyncengine:engine_up") == {"0": 0.0, "1": 0.0}


def test_dp2_embeds_as_dp1(make_llm):
    """Pooling requests through two engine cores (each in its own process): the default embedding model's
    vectors are DP=1's, request for request, whichever engine served each (to float32 rounding: each engine
    batches its own share, and a matmul's sums round by its batch)."""
    import numpy as np

    texts = [f"sentence number {i}: " + "the quick brown fox " * (i % 5) for i in range(12)]
    options = dict(runner="pooling", max_model_len=128)
    single = np.array([o.outputs.embedding for o in make_llm(None, **options).embed(texts)])
    both = make_llm(None, data_parallel_size=2, in_process=False, **options)
    np.testing.assert_allclose(np.array([o.outputs.embedding for o in both.embed(texts)]), single, atol=1e-6)
    assert len({d["pid"] for d in both.collective_rpc("describe")}) == 2
