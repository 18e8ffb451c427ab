"""Chat rendering over HTTP, in-process (Quart's test client over an AsyncEngine on the tiny Llama with a
byte-level tokenizer): what a conversation or its template options get wrong is a 400 naming the field,
never a 500 with Python's names in it (issue 13, defect 4); vLLM's `continue_final_message` and the
`chat_template_kwargs` vLLM accepts work; and long prompts, chats, /tokenize and /detokenize are
tokenized off the event loop (the loop guard fails the test otherwise)."""

from __future__ import annotations

import shutil
from contextlib import asynccontextmanager

import msgspec
import pytest

from asyncengine import AsyncEngine
from asyncengine.server.app import create_app
from asyncengine.server.config import ServerConfig
from support.tiny_tokenizer import CHAT_TEMPLATE, save_tiny_tokenizer

pytestmark = pytest.mark.anyio

# The tiny tokenizer's ChatML template, plus two ways for a template to fail on what it is given.
RAISING_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('this template takes no system message') }}"
    "{% endif %}{% if divide_by is defined %}{{ 1 // divide_by }}{% endif %}" + CHAT_TEMPLATE
)
HELLO = [{"role": "user", "content": "hi"}]
PYTHON_NAMES = ("Error", "Traceback", "render_chat", "got multiple values", "keyword argument", "()")


@pytest.fixture
def anyio_backend(request):
    # QuartTrio runs on trio only; the loop guard as in tests/conftest.py.
    from support.loop_guard import LoopBlockingGuard

    guard = LoopBlockingGuard()
    request.node.loop_guard = guard
    return ("trio", {"instruments": [guard]})


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-chat") / "llama"
    shutil.copytree(tiny_model("llama").path, directory)  # a copy: the shared tiny model stays tokenizer-less
    save_tiny_tokenizer(directory)
    return directory


@asynccontextmanager
async def client_of(chat_model, server_config: ServerConfig | None = None, **options):
    async with AsyncEngine.start(model=str(chat_model), max_model_len=128, kv_cache_memory_bytes=8 * 2**20,
                                 **options) as engine:
        app = create_app(engine, server_config or ServerConfig())
        async with app.test_app() as running:
            yield running.test_client()


async def post(client, path: str, body: dict) -> tuple[int, dict]:
    # msgspec, not the client's json=: encoding and decoding a megabyte must not block the loop either.
    response = await client.post(path, data=msgspec.json.encode(body), headers={"Content-Type": "application/json"})
    return response.status_code, msgspec.json.decode(await response.get_data())


def chat(messages, **fields) -> dict:
    return {"messages": messages, "max_tokens": 2, "ignore_eos": True, **fields}


def assert_bad_request(status: int, body: dict, param: str, *words: str) -> None:
    assert status == 400, body
    error = body["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    leaked = [name for name in PYTHON_NAMES if name in error["message"]]
    assert not leaked, f"Python internals {leaked} in {error['message']!r}"


async def test_what_a_conversation_or_its_template_options_get_wrong_is_a_400_naming_the_field(chat_model):
    async with client_of(chat_model, chat_template=RAISING_TEMPLATE) as client:
        assert_bad_request(*await post(client, "/v1/chat/completions", chat([])), "messages", "at least 1 item")
        assert_bad_request(*await post(client, "/tokenize", {"messages": []}), "messages", "messages is empty")
        # "self" and "conversation" would collide with apply_chat_template's own parameters (issue 30, item 8).
        for name in ("tokenize", "conversation", "chat_template", "messages", "self"):
            for path, body in (("/v1/chat/completions", chat(HELLO)), ("/tokenize", {"messages": HELLO})):
                status, body = await post(client, path, {**body, "chat_template_kwargs": {name: "x"}})
                assert_bad_request(status, body, f"chat_template_kwargs.{name}", f"chat_template_kwargs may not set "
                                                                                  f"'{name}'")
        status, body = await post(client, "/v1/chat/completions",
                                  chat(HELLO, chat_template_kwargs={"add_generation_prompt": "yes"}))
        assert_bad_request(status, body, "chat_template_kwargs.add_generation_prompt", "must be true or false")
        # A template that fails on the request: its own raise_exception, and an error evaluating it.
        status, body = await post(client, "/v1/chat/completions", chat([{"role": "system", "content": "s"}, *HELLO]))
        assert_bad_request(status, body, "messages", "the chat template failed on this request: this template takes "
                                                     "no system message")
        status, body = await post(client, "/tokenize", {"messages": HELLO, "chat_template_kwargs": {"divide_by": 0}})
        assert_bad_request(status, body, "messages", "the chat template failed on this request")
        # continue_final_message: not with a generation prompt, and only after the assistant's message.
        story = [*HELLO, {"role": "assistant", "content": "Once upon"}]
        status, body = await post(client, "/v1/chat/completions",
                                  chat(story, continue_final_message=True, add_generation_prompt=True))
        assert_bad_request(status, body, "continue_final_message", "cannot both be true")
        status, body = await post(client, "/v1/chat/completions", chat(HELLO, continue_final_message=True))
        assert_bad_request(status, body, "continue_final_message", "must be the assistant's", "'user'")
        status, body = await post(client, "/tokenize", {"messages": story,
                                                        "chat_template_kwargs": {"continue_final_message": True,
                                                                                 "add_generation_prompt": True}})
        assert_bad_request(status, body, "chat_template_kwargs.continue_final_message", "cannot both be true")
        # and the server goes on serving
        status, body = await post(client, "/v1/chat/completions", chat(HELLO))
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"


async def rendered(client, **fields) -> str:
    status, body = await post(client, "/tokenize", fields)
    assert status == 200, body
    status, text = await post(client, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200, text
    return text["prompt"]


async def test_continue_final_message_and_the_template_kwargs_vllm_accepts(chat_model):
    story = [*HELLO, {"role": "assistant", "content": "Once upon"}]
    async with client_of(chat_model) as client:
        assert await rendered(client, messages=HELLO) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        # vLLM lets chat_template_kwargs set add_generation_prompt (and the kwargs win over the field)
        for fields in ({"add_generation_prompt": False}, {"chat_template_kwargs": {"add_generation_prompt": False}},
                       {"add_generation_prompt": True, "chat_template_kwargs": {"add_generation_prompt": False}}):
            assert await rendered(client, messages=HELLO, **fields) == "<|im_start|>user\nhi<|im_end|>\n"
        # continue_final_message: the last message stays open, with no generation prompt after it
        continued = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon"
        assert await rendered(client, messages=story, continue_final_message=True) == continued
        kwargs = {"continue_final_message": True}
        assert await rendered(client, messages=story, chat_template_kwargs=kwargs) == continued
        status, body = await post(client, "/v1/chat/completions", chat(story, continue_final_message=True))
        assert status == 200, body
        status, tokens = await post(client, "/tokenize", {"prompt": continued, "add_special_tokens": False})
        assert body["usage"]["prompt_tokens"] == tokens["count"]
        # any other kwarg reaches the template as a variable (this one ignores it)
        status, body = await post(client, "/v1/chat/completions", chat(HELLO, chat_template_kwargs={"enable_thinking":
                                                                                                    False}))
        assert status == 200, body


class RawTokens(msgspec.Struct):
    count: int
    tokens: msgspec.Raw


LONG_TEXT = "hello world " * 90_000  # about 1 MB, one token per byte: about a second of tokenizing


async def test_long_prompts_chats_and_tokenize_routes_do_not_block_the_event_loop(chat_model):
    # (a body limit that lets the million token ids of the text back in, for /detokenize)
    async with client_of(chat_model, ServerConfig(max_request_body_bytes=16 * 2**20)) as client:
        # The million token ids stay raw JSON here: as Python ints, the test's own decoding and encoding of
        # them would be what blocks the loop.
        response = await client.post("/tokenize", data=msgspec.json.encode({"prompt": LONG_TEXT}),
                                     headers={"Content-Type": "application/json"})
        assert response.status_code == 200
        tokenized = msgspec.json.decode(await response.get_data(), type=RawTokens)
        assert tokenized.count == len(LONG_TEXT)
        response = await client.post("/detokenize", data=b'{"tokens": ' + bytes(tokenized.tokens) + b"}",
                                     headers={"Content-Type": "application/json"})
        assert response.status_code == 200
        assert msgspec.json.decode(await response.get_data())["prompt"] == LONG_TEXT
        status, body = await post(client, "/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 2})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        status, body = await post(client, "/v1/chat/completions", chat([{"role": "user", "content": LONG_TEXT}]))
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
