"""One request never fails the others: what a worker builds from one request's values (its LoRA
adapter, a logits processor's per-request check) is checked when the request joins the worker, where
failing fails that request alone (ModelRunnerOutput.failed_requests; finish reason "error" in the engine
core; a RequestError for its consumer), and the engine goes on.

First the model runner itself on the tiny Llama, fed a request it cannot serve (an adapter, on an engine
started without enable_lora); then a whole in-process engine with a logits processor that refuses one
request among several running at once. (Sampling values past the engine's types, such as top_k 2^63,
which on main killed the engine in the step, do not reach a worker: the frontend refuses them and the
wire's SamplingOptions does not decode them; tests/test_sampling_bounds.py.)
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from asyncengine import AsyncEngine, EngineConfig, RequestError, SamplingParams
from asyncengine.config.model import build_model_config
from asyncengine.interfaces.lora_resolver import LoRARequest
from asyncengine.plugin_runtime.records import StartupTrace
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.wire.engine_core import SamplingOptions
from asyncengine.wire.worker import CachedRequestData, NewRequestData, SchedulerOutput
from asyncengine.worker.model_runner import ModelRunner

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def llama_path(tiny_model) -> str:
    return str(tiny_model("llama").path)


@pytest.fixture
def runner(llama_path, cpu_platform) -> ModelRunner:
    config = EngineConfig(model=llama_path, skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks_override=32,
                          plugins="")
    model_config = build_model_config(config, model_dir=Path(llama_path), default_dtype="float32", tokenizer=None)
    StartupTrace("frontend")  # the role this process's records name (a no-op once an engine started here)
    runner = ModelRunner(config, model_config, torch.device("cpu"), CpuPlatform)
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


def new(request_id: str, block: int, lora_request: LoRARequest | None = None, **sampling) -> NewRequestData:
    return NewRequestData(request_id=request_id, prompt_token_ids=PROMPT, output_token_ids=[],
                          sampling=SamplingOptions(**sampling), block_ids=[block], num_computed_tokens=0,
                          lora_request=lora_request)


def decode(*request_ids: str) -> SchedulerOutput:
    return SchedulerOutput(
        cached_requests=[CachedRequestData(request_id=rid, new_block_ids=[], num_computed_tokens=len(PROMPT))
                         for rid in request_ids],
        num_scheduled_tokens={rid: 1 for rid in request_ids})


def test_a_request_the_worker_cannot_serve_fails_alone_in_the_worker(runner):
    adapter = LoRARequest(lora_name="adapter", lora_int_id=1, lora_path="/nonexistent")
    out = runner.execute_model(SchedulerOutput(new_requests=[new("good", 0, temperature=0.0),
                                                             new("bad", 1, adapter, temperature=0.0)],
                                               num_scheduled_tokens={"good": len(PROMPT), "bad": len(PROMPT)}))
    assert out.request_ids == ["good"]
    [failure] = out.failed_requests
    assert failure.request_id == "bad" and failure.field == "lora_request" and "enable_lora" in failure.message
    first = out.sampled_token_ids[0]

    # The next step was scheduled before the scheduler learnt of the failure (async scheduling): the
    # worker skips the failed request instead of failing the step on a request it does not hold.
    out = runner.execute_model(decode("good", "bad"))
    assert out.request_ids == ["good"] and out.failed_requests == []
    # Told to forget it, the worker holds nothing of it; the good request is as it would be alone.
    out = runner.execute_model(SchedulerOutput(finished_request_ids=["bad"], new_requests=[new("alone", 2,
                                               temperature=0.0)], num_scheduled_tokens={"alone": len(PROMPT)}))
    assert out.sampled_token_ids == [first]
    assert "bad" not in runner.requests and not runner.failed_request_ids


# --- a whole engine, with a logits processor refusing one request -------------------------------------

OPTIONS = dict(skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=8 * 2**20, plugins="",
               logits_processors=["support.refusing_logits:RefusingProcessor"], max_num_batched_tokens=16)


def params(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra or None)


async def tokens_of(engine: AsyncEngine, prompt: list[int], sampling: SamplingParams) -> list[list[int]]:
    completions: dict[int, list[int]] = {}
    async for output in engine.generate({"prompt_token_ids": prompt}, sampling):
        for completion in output.outputs:
            completions.setdefault(completion.index, []).extend(completion.token_ids)
    return [completions[index] for index in sorted(completions)]


@pytest.mark.anyio
async def test_a_logits_processor_refusing_one_request_fails_only_that_request(llama_path):
    prompts = [list(range(10, 30)), list(range(40, 47)), list(range(60, 75))]
    async with AsyncEngine.start(EngineConfig(model=llama_path, **OPTIONS)) as engine:
        alone = [await tokens_of(engine, prompt, params(6)) for prompt in prompts]
        results: dict[str, object] = {}

        async def run(name: str, prompt: list[int], sampling: SamplingParams) -> None:
            try:
                results[name] = await tokens_of(engine, prompt, sampling)
            except RequestError as error:
                results[name] = error

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "first", prompts[0], params(6))
                tg.start_soon(run, "refused", prompts[1], params(6, refuse=True))
                tg.start_soon(run, "refused n=3", prompts[1], SamplingParams(n=3, max_tokens=6,
                                                                             extra_args={"refuse": True}))
                tg.start_soon(run, "third", prompts[2], params(6))

        for name in ("refused", "refused n=3"):
            error = results[name]
            assert isinstance(error, RequestError), (name, error)
            assert error.field == "extra_args"
            assert "support.refusing_logits:RefusingProcessor" in error.message and "refuse" in error.message
        # The others ran in the same batches and got what they get alone.
        assert results["first"] == alone[0] and results["third"] == alone[2]
        # The engine goes on, and nothing of the refused requests is left in it.
        assert engine.is_running
        assert await tokens_of(engine, prompts[1], params(6)) == alone[1]
        stats = await engine.get_scheduler_stats()
        assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0
