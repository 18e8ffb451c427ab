"""An in-process engine closes every stream it opened: after `async with AsyncEngine.start(...)` ends,
the garbage collector finds no unclosed anyio memory stream (ResourceWarning). Before, the in-process
engine-core client left both receive ends (the loop's inbox and the frontend's outputs) to the
collector, two warnings per engine, reported in whichever later test the collector ran in."""

from __future__ import annotations

import gc
import warnings

import anyio
import pytest

from asyncengine import AsyncEngine, SamplingParams


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_an_in_process_engine_leaves_no_unclosed_stream(tiny_model, backend):
    model = tiny_model("llama")

    async def serve_one_request() -> list[int]:
        tokens: list[int] = []
        async with AsyncEngine.start(model=str(model.path), skip_tokenizer_init=True, max_model_len=512,
                                     kv_cache_memory_bytes=8 * 2**20) as engine:
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            async for output in engine.generate({"prompt_token_ids": [1, 2, 3]}, params):
                tokens += output.outputs[0].token_ids
        return tokens

    gc.collect()  # what earlier tests left is not this test's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        tokens = anyio.run(serve_one_request, backend=backend)
        gc.collect()
    assert len(tokens) == 3
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == [], unclosed
