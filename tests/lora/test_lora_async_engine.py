"""AsyncEngine.generate and open_stream with a LoRARequest, on trio (with the event-loop guard: the adapter's
config is read off the loop) and asyncio."""

from __future__ import annotations

import pytest

from asyncengine import AsyncEngine, SamplingParams
from asyncengine.interfaces.lora_resolver import LoRARequest
from support.lora_adapters import write_adapter

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}


async def _tokens(outputs) -> list[int]:
    tokens: list[int] = []
    async for output in outputs:
        tokens += output.outputs[0].token_ids
    return tokens


@pytest.fixture
def setup(tiny_model, tmp_path):
    """Built outside the event loop: building the tiny model, writing the adapter and importing the engine's
    modules (the first in-process start imports them, seconds on a loaded machine) block."""
    import asyncengine.engine_core.core  # noqa: F401
    import asyncengine.lora.pool  # noqa: F401
    import asyncengine.worker.worker  # noqa: F401
    adapter = write_adapter(tmp_path / "a", seed=3, targets=("q_proj", "down_proj"))
    return str(tiny_model("llama").path), LoRARequest("async-a", 7, str(adapter))


async def test_async_engine_runs_adapters(setup):
    model, lora = setup
    async with AsyncEngine.start(model=model, skip_tokenizer_init=True, dtype="float32",
                                 enable_lora=True, max_model_len=64, num_gpu_blocks_override=16) as engine:
        base = await _tokens(engine.generate(PROMPT, PARAMS))
        adapted = await _tokens(engine.generate(PROMPT, PARAMS, lora_request=lora))
        streamed = await _tokens(await engine.open_stream([5, 6, 7, 8, 9], PARAMS, lora_request=lora))
    assert len(base) == len(adapted) == 4
    assert adapted != base and streamed == adapted
