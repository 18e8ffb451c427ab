"""The parent-child hand-shake: private Unix sockets, TCP with a secret, strangers dropped."""

from __future__ import annotations

import os
import stat

import anyio
import pytest

from asyncengine import AsyncEngine, SamplingParams
from asyncengine.runtime.connection import accept_child, connect_to_parent, open_listener
from asyncengine.wire.messages import ExecutorInbox

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_a_child_with_the_wrong_secret_is_dropped(transport):
    listener = await open_listener(transport)
    try:
        if transport == "unix":
            directory = os.path.dirname(listener.address.removeprefix("unix:"))
            assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700

        async def stranger_then_child():
            stranger = await connect_to_parent(listener.address, "not-the-secret", ExecutorInbox, role="worker", rank=7)
            with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                await stranger.receive()  # the parent hangs up on it
            await connect_to_parent(listener.address, listener.secret, ExecutorInbox, role="worker", rank=1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stranger_then_child)
            frames, hello = await accept_child(listener, ExecutorInbox, role="worker", timeout=10)
        assert (hello.role, hello.rank) == ("worker", 1)
        await frames.aclose()
    finally:
        await listener.aclose()


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_engine_core_over_tcp(llama):
    async with AsyncEngine.start(model=str(llama.path), skip_tokenizer_init=True, max_model_len=128,
                                 kv_cache_memory_bytes=2**22, in_process=False, transport="tcp") as engine:
        tokens = []
        async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)):
            tokens += out.outputs[0].token_ids
        assert len(tokens) == 8
