from __future__ import annotations

import pytest

from asyncengine import SamplingParams
from asyncengine.frontend.async_engine import AsyncEngine

pytestmark = pytest.mark.anyio


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")  # built here, not on the event loop


async def test_stream(llama):
    model = llama
    async with AsyncEngine.start(model=str(model.path), skip_tokenizer_init=True, max_model_len=128,
                                 kv_cache_memory_bytes=2**22) as engine:
        tokens = []
        async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)):
            tokens += out.outputs[0].token_ids
        assert len(tokens) == 10
