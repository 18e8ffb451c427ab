"""Acceptance 1 and 4 of issue 18 on the real default pooling model, all-MiniLM-L6-v2 from its PyPI package.

Embeddings equal sentence-transformers' (cosine >= 0.9999, float32) on 72 sentences of mixed lengths, one at a
time and batched, through LLM.embed and through /v1/embeddings with the official openai client (float and
base64). The reference is data/minilm_reference.npy, written by make_minilm_reference.py with
sentence-transformers (not a dependency of the project). Bad input is a 400 naming the field.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest

from support.pooling_sentences import sentences
from support.server import start_server

REFERENCE = np.load(Path(__file__).parent / "data" / "minilm_reference.npy")
SENTENCES = sentences()


def cosines(got: np.ndarray) -> np.ndarray:
    got = np.asarray(got, dtype=np.float64)
    ref = REFERENCE.astype(np.float64)
    return (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)


@pytest.fixture(scope="module")
def llm():
    from asyncengine import LLM

    with LLM(runner="pooling", dtype="float32") as llm:
        yield llm


@pytest.fixture(scope="module")
def server():
    server = start_server(["--runner", "pooling", "--dtype", "float32"])
    yield server
    server.stop()


def test_the_default_pooling_model_is_minilm_with_its_mean_pooler(llm):
    config = llm.engine.model_config
    assert config.served_model_name == "all-MiniLM-L6-v2" and config.architectures == ["BertModel"]
    assert (config.pooler.pooling_type, config.pooler.normalize) == ("MEAN", True)
    assert config.max_model_len == 256  # sentence-transformers' max_seq_length
    (record,) = [r for r in llm.engine.startup_report if r.plugin == "pooler"]
    assert record.reason.startswith("MEAN (asyncengine.pooling.poolers:MeanPooler), chosen by sentence-transformers'")


def test_llm_embed_batched_equals_sentence_transformers(llm):
    outputs = llm.embed(SENTENCES)
    assert len({len(o.prompt_token_ids) for o in outputs}) > 20  # mixed lengths, batched together
    got = np.array([o.outputs.embedding for o in outputs])
    assert cosines(got).min() >= 0.9999
    assert np.abs(np.linalg.norm(got, axis=1) - 1).max() < 1e-5  # sentence-transformers' Normalize module


def test_llm_embed_one_at_a_time_equals_sentence_transformers(llm):
    got = np.array([llm.embed(sentence)[0].outputs.embedding for sentence in SENTENCES])
    assert cosines(got).min() >= 0.9999


def test_v1_embeddings_through_the_openai_client_float_and_base64(server):
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0) as client:
        floats = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES, encoding_format="float")
        # Without encoding_format the client asks for base64 and decodes it (float32) itself.
        decoded = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES)
        single = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES[40])
    assert [d.index for d in floats.data] == list(range(len(SENTENCES)))
    assert cosines(np.array([d.embedding for d in floats.data])).min() >= 0.9999
    assert cosines(np.array([d.embedding for d in decoded.data])).min() >= 0.9999
    assert float(np.dot(single.data[0].embedding, REFERENCE[40])) >= 0.9999
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(SENTENCES)


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("body, param, words", [
    ({"input": []}, "input", "input is empty"),
    ({"input": [101, 7592, 30522, 102]}, "input", "token id 30522 in input is outside the vocabulary"),
    ({"input": ["fine", [101, 99999]]}, "input", "mixes strings"),
    ({"input": ["fine", "word " * 300]}, "input[1]", "more than max_model_len (256)"),
    ({"input": "hello", "dimensions": 64}, "dimensions", "not a Matryoshka model"),
    ({"input": "hello", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "positive integer"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param, words):
    status, answer = post(server, "/v1/embeddings", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer


def test_truncate_prompt_tokens_keeps_a_long_input(server):
    status, answer = post(server, "/v1/embeddings", {"input": "word " * 300, "truncate_prompt_tokens": 20})
    assert status == 200 and answer["usage"]["prompt_tokens"] == 20


def test_a_pooling_model_refuses_to_generate_instead_of_dying(llm, server):
    from asyncengine import RequestError

    with pytest.raises(RequestError, match="runs as a pooling model") as caught:
        llm.generate("Hello")
    assert caught.value.field == "model"
    assert llm.embed("still serving")[0].outputs.embedding  # the engine lives on
    status, answer = post(server, "/v1/completions", {"prompt": "Hello"})
    assert status == 400 and answer["error"]["param"] == "model", answer
