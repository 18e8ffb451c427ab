"""Pooling requests in the engine (issue 18): prefill-only in the scheduler (scheduled whole, no prefix cache,
finished by their pooled output with their blocks freed), batched with generation in one engine, and
AsyncEngine.encode on trio and asyncio (cancelling it aborts the request); the pooler choice from
sentence-transformers' files."""

from __future__ import annotations

import json

import anyio
import pytest
import torch

from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.scheduler import Scheduler
from asyncengine.errors import ModelLoadError
from asyncengine.config.pooling import resolve_pooler_config
from asyncengine.wire.engine_core import EngineCoreRequest, FinishReason, SamplingOptions
from asyncengine.wire.pooling import PooledTensor, PoolingOptions
from asyncengine.wire.worker import ModelRunnerOutput
from support.platforms import use_platform

POOLING = PoolingOptions(task="embed")
VECTOR = PooledTensor(data=b"\0" * 16, shape=[4])


def _scheduler(budget: int = 64, num_blocks: int = 32) -> Scheduler:
    return Scheduler(block_manager=BlockManager(num_blocks, 16, enable_prefix_caching=True), max_num_seqs=8,
                     max_num_batched_tokens=budget, max_model_len=256)


def _request(request_id: str, tokens: list[int], pooling: PoolingOptions | None = POOLING) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=tokens,
                             sampling=SamplingOptions(max_tokens=4), pooling=pooling)


def test_a_pooling_request_is_prefill_only_and_frees_its_blocks_with_its_output():
    scheduler = _scheduler()
    free = scheduler.block_manager.num_free_blocks
    scheduler.add_request(_request("gen", list(range(1, 11)), pooling=None))
    scheduler.add_request(_request("pool", list(range(1, 41))))
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"gen": 10, "pool": 40}
    assert [r.pooling for r in step.new_requests] == [None, POOLING]
    # Async scheduling: the next step is made before this one's output; the pooling request is not in it.
    ahead = scheduler.schedule()
    assert ahead.num_scheduled_tokens == {"gen": 1}
    outputs = scheduler.update_from_output(step, ModelRunnerOutput(
        request_ids=["gen"], sampled_token_ids=[7], pooled_request_ids=["pool"], pooled=[VECTOR])).outputs
    pooled = next(o for o in outputs if o.request_id == "pool")
    assert pooled.finish_reason == FinishReason.STOP and pooled.pooled == VECTOR and pooled.new_token_ids == []
    assert "pool" not in scheduler.sequences and "gen" in scheduler.sequences
    assert scheduler.block_manager.num_free_blocks == free - 1  # only the generation's block is still held
    assert "pool" in scheduler.schedule().finished_request_ids  # the worker forgets it


def test_a_pooling_request_is_never_chunked_nor_served_from_the_prefix_cache():
    scheduler = _scheduler(budget=32)
    scheduler.add_request(_request("gen", list(range(1, 33)), pooling=None))
    scheduler.add_request(_request("long", list(range(1, 41))))  # 40 tokens: more than the 32 left this step
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"gen": 32}  # a generation prompt would be chunked; this one waits
    scheduler.update_from_output(first, ModelRunnerOutput(request_ids=["gen"], sampled_token_ids=[5]))
    scheduler.finish_requests(["gen"])  # its two full blocks stay in the prefix cache
    scheduler = _scheduler(budget=64)
    scheduler.add_request(_request("gen", list(range(1, 33)), pooling=None))
    step = scheduler.schedule()
    scheduler.update_from_output(step, ModelRunnerOutput(request_ids=["gen"], sampled_token_ids=[5]))
    scheduler.finish_requests(["gen"])
    scheduler.add_request(_request("same-prefix", list(range(1, 41))))
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"same-prefix": 40}  # every token computed: none from the cache
    assert step.new_requests[0].num_computed_tokens == 0


def _write_st_files(directory, modules, pooling):
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


ST_MODULES = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
              {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]


def test_the_pooler_comes_from_sentence_transformers_files_then_the_option(tmp_path):
    _write_st_files(tmp_path, ST_MODULES, {"pooling_mode_lasttoken": True})
    chosen = resolve_pooler_config(None, tmp_path, {"model_type": "qwen3"}, ["Qwen3ForCausalLM"])
    assert (chosen.pooling_type, chosen.normalize) == ("LAST", False)  # no Normalize module
    chosen = resolve_pooler_config({"pooling_type": "MEAN", "normalize": True}, tmp_path, {}, ["Qwen3ForCausalLM"])
    assert (chosen.pooling_type, chosen.normalize, chosen.source) == ("MEAN", True, "--pooler-config")


def test_sentence_transformers_modules_we_do_not_run_are_refused(tmp_path):
    _write_st_files(tmp_path, [*ST_MODULES, {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
                    {"pooling_mode_mean_tokens": True})
    with pytest.raises(ModelLoadError, match="sentence_transformers.models.Dense, which asyncengine does not run"):
        resolve_pooler_config(None, tmp_path, {"model_type": "bert"}, ["BertModel"])


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return tiny_model("qwen3")  # the session's (the parity tests use it too)


def test_a_generation_engine_embeds_while_it_generates(qwen3):
    from asyncengine import LLM, SamplingParams

    with LLM(str(qwen3.path), dtype="float32", skip_tokenizer_init=True, max_model_len=128) as llm:
        assert llm.engine.model_config.runner == "generate"

        async def both():
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            results: dict[str, object] = {"tokens": []}

            async def generate():
                async for out in llm.engine.generate({"prompt_token_ids": [5, 6, 7]}, params):
                    results["tokens"] += out.outputs[0].token_ids  # (each output carries what is new)

            async def embed():
                await anyio.sleep(0.05)  # while the generation decodes
                results["vector"] = await llm.engine.pool({"prompt_token_ids": [9, 10, 11, 12]})

            async with anyio.create_task_group() as tg:
                tg.start_soon(generate)
                tg.start_soon(embed)
            return results

        results = llm._portal.call(both)
    assert len(results["tokens"]) == 24
    with torch.no_grad():
        hidden = qwen3.hf_model.model(torch.tensor([[9, 10, 11, 12]])).last_hidden_state[0, -1]
    assert (results["vector"].outputs.data - torch.nn.functional.normalize(hidden, dim=-1)).abs().max() <= 1e-4


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_async_engine_encode_on_both_backends_and_cancelling_aborts(qwen3, backend):
    from asyncengine import AsyncEngine

    async def main():
        async with AsyncEngine.start(model=str(qwen3.path), runner="pooling", dtype="float32",
                                     skip_tokenizer_init=True, max_model_len=128) as engine:
            outputs = [out async for out in engine.encode([5, 6, 7, 8], request_id="mine")]
            assert len(outputs) == 1 and outputs[0].request_id == "mine" and outputs[0].finished
            assert outputs[0].outputs.data.shape == (64,)
            with anyio.move_on_after(0):  # cancelled at once: nothing is left behind
                await engine.pool([5, 6, 7, 8])
            assert len(engine._requests) == 0
            stats = await engine.get_scheduler_stats()
            assert stats.num_running_reqs == stats.num_waiting_reqs == 0

    anyio.run(main, backend=backend)


def _runner(qwen3, monkeypatch, **options):
    from pathlib import Path

    from asyncengine.config.engine import EngineConfig
    from asyncengine.config.model import build_model_config
    from asyncengine.models.layers import op_registry
    from asyncengine.plugin_runtime import platform_resolution as resolution
    from asyncengine.platforms.cpu import CpuPlatform
    from asyncengine.plugin_runtime.records import StartupTrace
    from asyncengine.worker.model_runner import ModelRunner

    use_platform(monkeypatch, CpuPlatform)
    monkeypatch.setattr(op_registry, "_chains", {})
    config = EngineConfig(model=str(qwen3.path), skip_tokenizer_init=True, max_model_len=64, plugins="", **options)
    model_config = build_model_config(config, model_dir=Path(qwen3.path), default_dtype="float32", tokenizer=None)
    StartupTrace("frontend")
    runner = ModelRunner(config, model_config, torch.device("cpu"), CpuPlatform)
    runner.load_model()
    return runner


def test_a_decoder_run_as_a_pooling_model_profiles_its_pooler_not_an_lm_head(qwen3, monkeypatch):
    """The device KV budget (CUDA) profiles a peak-sized forward pass: for a pooling model it must end in the
    pooler, since the LM head is gone (as_pooling_model), instead of failing start-up."""
    runner = _runner(qwen3, monkeypatch, runner="pooling")
    runner._profile_forward(48)  # raised "runs as a pooling model: it samples nothing" before
    assert runner.requests == {} and runner.kv_caches == []


def test_a_worker_without_a_pooler_fails_a_pooling_request_instead_of_dropping_it(qwen3, monkeypatch):
    from asyncengine.wire.worker import NewRequestData, SchedulerOutput

    runner = _runner(qwen3, monkeypatch, num_gpu_blocks_override=8)
    runner.initialize_kv_cache(runner.determine_num_blocks())
    runner.pooling_step = None  # as for a model whose files ask for a pooling we do not do
    new = NewRequestData(request_id="p", prompt_token_ids=[5, 6, 7], output_token_ids=[], sampling=SamplingOptions(),
                         block_ids=[0], num_computed_tokens=0, pooling=POOLING)
    output = runner.execute_model(SchedulerOutput(new_requests=[new], num_scheduled_tokens={"p": 3}))
    assert [(f.request_id, f.field) for f in output.failed_requests] == [("p", "model")]
    assert output.pooled_request_ids == []


def test_pooling_requests_take_places_under_max_waiting_requests_as_generations_do(tmp_path):
    """A pooling request holds a place under max_waiting_requests until its output arrives, like a generation:
    with the one place taken, a generation or a pooling request with nowait is refused (EngineOverloadedError),
    the server's pooling route answers 503 engine_overloaded with Retry-After (as the generation routes do), a
    pooling request without nowait waits for room; every place is given back at the end."""
    from asyncengine import AsyncEngine, EngineOverloadedError, SamplingParams
    from asyncengine.server.app import create_app
    from asyncengine.server.config import ServerConfig

    from support.tiny_models import build_tiny_model

    # The running request must outlive every check below: on the CPU fast path a tiny model decodes a token in about
    # a millisecond, so 450 tokens (the session model's whole context) once ended before the checks did. A model of
    # its own with a long context lets the generation run for tens of seconds; it is aborted long before it ends.
    qwen3 = build_tiny_model("qwen3", tmp_path / "qwen3-long", max_position_embeddings=32768)
    long = SamplingParams(temperature=0.0, max_tokens=32000, ignore_eos=True)

    async def wait_for_waiting(engine, count: int) -> None:
        with anyio.fail_after(60):
            while (await engine.get_scheduler_stats()).num_waiting_reqs != count:
                await anyio.sleep(0.02)

    async def main():
        async with AsyncEngine.start(model=str(qwen3.path), dtype="float32", skip_tokenizer_init=True,
                                     max_model_len=32768, max_num_seqs=1, max_waiting_requests=1,
                                     kv_cache_memory_bytes=2**25) as engine:
            app = create_app(engine, ServerConfig())
            async with app.test_app() as running:
                client = running.test_client()
                results: dict[str, object] = {}
                running_one = anyio.Event()

                async def generate() -> None:
                    async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, long, request_id="long"):
                        running_one.set()

                async def pool(name: str, tokens: list[int]) -> None:
                    results[name] = await engine.pool(tokens)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(generate)
                    await running_one.wait()  # running: max_num_seqs=1 keeps the pooling request waiting
                    tg.start_soon(pool, "queued", [9, 10, 11])
                    await wait_for_waiting(engine, 1)
                    with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
                        await engine.generate({"prompt_token_ids": [8]}, long, nowait=True).__anext__()
                    with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
                        await engine.pool([12, 13], nowait=True)
                    response = await client.post("/v1/embeddings", json={"input": [12, 13]})
                    body = await response.get_json()
                    assert response.status_code == 503, body
                    assert body["error"]["code"] == "engine_overloaded" and response.headers["Retry-After"] == "1"
                    tg.start_soon(pool, "patient", [12, 13])  # no nowait: it waits at the gate, not in the core
                    await anyio.sleep(0.2)
                    assert (await engine.get_scheduler_stats()).num_waiting_reqs == 1 and "patient" not in results
                    await engine.abort("long")
                assert {"queued", "patient"} <= set(results)
                assert engine._requests.gate.count == 0 and len(engine._requests) == 0
                response = await client.post("/v1/embeddings", json={"input": [[12, 13]]})
                assert response.status_code == 200 and len((await response.get_json())["data"]) == 1
                # More inputs than max_waiting_requests holds could never all get in: a 400 naming them.
                response = await client.post("/v1/embeddings", json={"input": [[12, 13], [14, 15]]})
                body = await response.get_json()
                assert response.status_code == 400 and body["error"]["param"] == "input", body
                assert "max_waiting_requests" in body["error"]["message"]

    anyio.run(main, backend="trio")
