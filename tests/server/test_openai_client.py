"""The real server through the official `openai` client, sync and async, streaming and not: outputs
equal the engine's own greedy outputs (the same model in an in-process LLM)."""

from __future__ import annotations

import json
import urllib.request

import anyio
import openai
import pytest

from asyncengine import SamplingParams
from support.server import API_KEY, MODEL_NAME

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,"]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def client(smol_server):
    with openai.OpenAI(base_url=smol_server.base_url, api_key=API_KEY, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def expected(smol_llm):
    """The engine's own greedy text for each prompt (16 tokens) and for the chat (24 tokens)."""
    completions = [o.outputs[0] for o in smol_llm.generate(PROMPTS, greedy(16))]
    chat = smol_llm.chat(CHAT, greedy(24))[0].outputs[0]
    return {"completions": completions, "chat": chat}


def test_models_lists_the_served_model(client):
    (model,) = client.models.list().data
    assert model.id == MODEL_NAME and model.owned_by == "asyncengine"


def test_completion_equals_the_engine(client, expected):
    for prompt, want in zip(PROMPTS, expected["completions"]):
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
        (choice,) = response.choices
        assert choice.text == want.text
        assert choice.finish_reason == want.finish_reason
        assert response.usage.completion_tokens == len(want.token_ids)


def test_a_list_of_prompts_in_one_request(client, expected):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=16, temperature=0)
    assert [c.index for c in response.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in response.choices] == [w.text for w in expected["completions"]]


def test_streamed_completion_equals_the_engine_and_reports_usage(client, expected):
    want = expected["completions"][1]
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert len([c for c in chunks if c.choices]) > 1  # it streamed, in several events
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_streaming_several_prompts_with_n(client):
    params = dict(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=8, temperature=0.8, seed=7, n=2)
    whole = client.completions.create(**params)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**params, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert sorted(streamed) == [0, 1, 2, 3]
    assert [streamed[c.index] for c in whole.choices] == [c.text for c in whole.choices]


def test_chat_equals_the_engine(client, expected):
    response = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=24, temperature=0)
    message = response.choices[0].message
    assert message.role == "assistant" and message.content == expected["chat"].text
    assert response.usage.completion_tokens == len(expected["chat"].token_ids)


def test_streamed_chat_equals_the_engine(client, expected):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=24, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["chat"].text
    assert chunks[-1].choices[0].finish_reason == expected["chat"].finish_reason


def test_logprobs_match_the_engine(client, smol_llm):
    want = smol_llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0].outputs[0]
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([lp[t] for t, lp in zip(want.token_ids, want.logprobs)], abs=1e-4)
    assert all(3 <= len(top) <= 4 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(item.top_logprobs) == 2 for item in content)
    assert all(item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob for item in content)


def test_stop_strings_and_max_completion_tokens(client):
    response = client.completions.create(model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=32, temperature=0,
                                         stop=[" 7"])
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and " 7" not in choice.text and choice.text.startswith(" 5")
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=2, temperature=0)
    assert chat.usage.completion_tokens == 2 and chat.choices[0].finish_reason == "length"


def test_request_id_is_honoured_and_echoed(client):
    raw = client.completions.with_raw_response.create(model=MODEL_NAME, prompt="Hi", max_tokens=2,
                                                      extra_headers={"X-Request-Id": "my-request-42"})
    assert raw.headers["x-request-id"] == "my-request-42"
    assert raw.parse().id == "cmpl-my-request-42"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_async_client_concurrent_requests_equal_the_engine(smol_server, expected, anyio_backend):
    results: dict[int, str] = {}
    async with openai.AsyncOpenAI(base_url=smol_server.base_url, api_key=API_KEY, max_retries=0) as client:
        async def complete(index: int) -> None:
            if index % 2:
                stream = await client.completions.create(model=MODEL_NAME, prompt=PROMPTS[index], max_tokens=16,
                                                         temperature=0, stream=True)
                results[index] = "".join([c.choices[0].text async for c in stream if c.choices])
            else:
                response = await client.completions.create(model=MODEL_NAME, prompt=PROMPTS[index], max_tokens=16,
                                                           temperature=0)
                results[index] = response.choices[0].text

        async with anyio.create_task_group() as tg:
            for index in range(len(PROMPTS)):
                tg.start_soon(complete, index)
    assert [results[i] for i in range(len(PROMPTS))] == [w.text for w in expected["completions"]]


def test_tokenize_detokenize_health_and_the_startup_report(smol_server, smol_llm):
    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(smol_server.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {API_KEY}"})  # --api-key covers these too
        with urllib.request.urlopen(request) as response:
            return json.loads(response.read())

    tokens = post("/tokenize", {"prompt": "Hello world"})
    assert tokens["tokens"] == smol_llm.get_tokenizer().encode("Hello world") and tokens["count"] == len(tokens["tokens"])
    assert post("/detokenize", {"tokens": tokens["tokens"]})["prompt"] == "Hello world"
    with urllib.request.urlopen(smol_server.url + "/health") as response:
        assert response.status == 200
    request = urllib.request.Request(smol_server.base_url + "/startup", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request) as response:
        records = json.loads(response.read())
    roles = {(r["pid"], r["role"]) for r in records}
    assert {role for _, role in roles} == {"frontend", "engine core"} and len({pid for pid, _ in roles}) == 2
    assert smol_server.process.pid in {pid for pid, role in roles if role == "frontend"}
