"""Tokenizing, detokenizing and chat rendering run in the engine's tokenizer pool, never on the event loop.

A 1 MB prompt takes a tokenizer about a second (the tiny byte-level tokenizer here makes one token per
byte): on the loop that would stall every stream for that long. On trio the loop guard of
tests/conftest.py fails a test whose loop was blocked; on asyncio, asyncio's own debug mode reports
each callback that ran longer than the same threshold (`slow_callback_duration`), and the test fails
if it reported one.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from contextlib import contextmanager

import anyio
import pytest

from asyncengine import AsyncEngine, SamplingParams
from asyncengine.errors import RequestError
from asyncengine.frontend.tokenizer_pool import TokenizerPool
from support.loop_guard import DEFAULT_THRESHOLD
from support.tiny_tokenizer import save_tiny_tokenizer

pytestmark = pytest.mark.anyio

LONG_TEXT = "hello world " * 90_000  # about 1 MB: one token per byte


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-with-tokenizer") / "llama"
    shutil.copytree(tiny_model("llama").path, directory)  # a copy: the shared tiny model stays tokenizer-less
    save_tiny_tokenizer(directory)
    return directory


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Executing"):
            self.messages.append(record.getMessage())


@contextmanager
def no_slow_asyncio_callbacks():
    """On asyncio: fail if a callback (a task step) ran longer than the loop guard's threshold."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # trio: the loop guard watches
        yield
        return
    debug, duration = loop.get_debug(), loop.slow_callback_duration
    records = _Records()
    logging.getLogger("asyncio").addHandler(records)
    loop.set_debug(True)
    loop.slow_callback_duration = DEFAULT_THRESHOLD
    try:
        yield
    finally:
        loop.set_debug(debug)
        loop.slow_callback_duration = duration
        logging.getLogger("asyncio").removeHandler(records)
    assert not records.messages, f"the event loop was blocked: {records.messages}"


def engine_options(chat_model) -> dict:
    return dict(model=str(chat_model), max_model_len=128, kv_cache_memory_bytes=8 * 2**20)


async def test_prompts_chats_tokenize_and_detokenize_run_off_the_event_loop(chat_model):
    async with AsyncEngine.start(**engine_options(chat_model)) as engine:
        with no_slow_asyncio_callbacks():
            with pytest.raises(RequestError) as info:  # far longer than max_model_len, which it says after tokenizing
                async for _ in engine.generate(LONG_TEXT, SamplingParams(max_tokens=2)):
                    pass
            assert info.value.field == "prompt" and f"{len(LONG_TEXT)} tokens" in str(info.value)
            # A short one runs, through the same pool.
            outputs = [o async for o in engine.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True))]
            assert outputs[-1].finished and outputs[-1].prompt_token_ids == await engine.tokenize("hello")

            token_ids = await engine.tokenize(LONG_TEXT)
            assert len(token_ids) == len(LONG_TEXT)
            assert await engine.detokenize(token_ids) == LONG_TEXT
            text = await engine.render_chat([{"role": "user", "content": LONG_TEXT}])
            assert text == f"<|im_start|>user\n{LONG_TEXT}<|im_end|>\n<|im_start|>assistant\n"
            prompt = await engine.chat_prompt([{"role": "user", "content": "hi"}])
            assert prompt["prompt_token_ids"] == await engine.tokenize(prompt["prompt"], add_special_tokens=False)


async def test_the_pool_runs_at_most_its_size_at_once():
    pool = TokenizerPool(2)
    running, most = 0, 0
    lock = threading.Lock()

    def work() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05)
        with lock:
            running -= 1

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(pool.run, work)
    assert 1 <= most <= 2 and pool.size == 2  # anyio's default limiter would have let all six in


def test_a_pool_needs_a_thread():
    with pytest.raises(ValueError, match="at least one thread"):
        TokenizerPool(0)


@pytest.mark.parametrize("name", ["bytelevel_tokenizer", "metaspace_tokenizer"])
def test_the_pool_s_encode_and_decode_give_what_the_tokenizer_s_own_methods_give(request, name, sample_texts):
    # encode_text / decode_ids call a transformers fast tokenizer's Rust tokenizer directly (it releases
    # the GIL): the ids and the texts must be the tokenizer's own.
    from asyncengine.frontend.tokenizer import decode_ids, encode_text

    tokenizer = request.getfixturevalue(name)
    for text in [*sample_texts, "", "<s> special </s> tokens <|im_end|>"]:
        for add_special_tokens in (True, False):
            assert encode_text(tokenizer, text, add_special_tokens=add_special_tokens) == \
                tokenizer.encode(text, add_special_tokens=add_special_tokens)
        ids = tokenizer.encode(text)
        for skip in (True, False):
            assert decode_ids(tokenizer, ids, skip_special_tokens=skip) == \
                tokenizer.decode(ids, skip_special_tokens=skip)
