"""A worker that raises mid-generation: every caller gets EngineDeadError naming it and the error."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from asyncengine import AsyncEngine, EngineDeadError, SamplingParams

pytestmark = pytest.mark.anyio
TESTS_DIR = str(Path(__file__).resolve().parent.parent)


@pytest.fixture
def anyio_backend():
    return "trio"


@pytest.fixture
def llama(tiny_model, monkeypatch):
    # Worker processes import the exploding model class from tests/support.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    return tiny_model("llama")


@pytest.mark.parametrize("placement", [
    dict(in_process=True),
    dict(in_process=True, distributed_executor_backend="mp"),
    dict(in_process=False),
], ids=["in-process thread", "worker process", "engine-core process"])
async def test_a_worker_that_raises_fails_every_request_with_the_culprit(llama, placement):
    options = dict(
        model=str(llama.path), skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=2**23,
        model_class_overrides={"LlamaForCausalLM": "support.exploding_model:ExplodingLlama"}, **placement,
    )
    errors: list[BaseException] = []
    async with AsyncEngine.start(**options) as engine:
        async def consume(prompt):
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            try:
                async for _ in engine.generate({"prompt_token_ids": prompt}, params):
                    pass
            except EngineDeadError as exc:
                errors.append(exc)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for prompt in ([5, 6, 7], [8, 9], list(range(10, 30))):
                    tg.start_soon(consume, prompt)
        assert len(errors) == 3
        message = str(errors[0])
        assert "RuntimeError: boom at forward pass 5" in message and "worker" in message
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate({"prompt_token_ids": [1, 2]}):
                pass
