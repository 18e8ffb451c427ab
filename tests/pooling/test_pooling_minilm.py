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
    ({"input": []}, "input", "input must hold at least 1 item"),
    ({"input": [101, 7592, 30522, 102]}, "input[2]", "must be at most 30521 (max_token_id=30521"),
    ({"input": ["fine", [101, 99999]]}, "input[1][1]", "outside the vocabulary"),  # bounds first, at the edge
    ({"input": ["fine", [101, 102]]}, "input", "mixes strings"),
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


# -- vLLM's and Cohere's other pooling routes (issue 32), on the same server ---------------------------------

PAIR_QUERY = "What do cats eat?"
PAIR_DOCUMENTS = ["Cats are carnivores and eat meat.", "The stock market closed higher.", "Cats sleep a lot."]


def embedded(server, texts: list[str]) -> np.ndarray:
    status, answer = post(server, "/v1/embeddings", {"input": texts})
    assert status == 200, answer
    return np.array([item["embedding"] for item in answer["data"]])


def test_v1_score_takes_each_of_vllms_pairs_and_scores_the_cosine_of_the_embeddings(server):
    vectors = embedded(server, [PAIR_QUERY, *PAIR_DOCUMENTS])
    expected = [float(np.dot(vectors[0], v) / np.linalg.norm(vectors[0]) / np.linalg.norm(v)) for v in vectors[1:]]
    for path in ("/score", "/v1/score"):
        for first, second in [("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                              ("data_1", "data_2")]:
            status, answer = post(server, path, {first: PAIR_QUERY, second: PAIR_DOCUMENTS})
            assert status == 200, (path, first, answer)
            assert [item["index"] for item in answer["data"]] == [0, 1, 2]
            assert np.allclose([item["score"] for item in answer["data"]], expected, atol=1e-5), (path, first)
    # Not exactly one pair: a 400 that names what was sent and what to send.
    for body in [{"text_1": PAIR_QUERY}, {"text_1": "a", "text_2": "b", "queries": "c"}, {}]:
        status, answer = post(server, "/v1/score", body)
        assert status == 400 and "send one pair of texts" in answer["error"]["message"], (body, answer)


def test_v2_rerank_ranks_as_rerank(server):
    body = {"query": PAIR_QUERY, "documents": PAIR_DOCUMENTS, "top_n": 2}
    status, v2 = post(server, "/v2/rerank", body)
    assert status == 200, v2
    status, v1 = post(server, "/rerank", body)
    assert v2["results"] == v1["results"] and len(v2["results"]) == 2
    assert v2["results"][0]["index"] == 0  # the document about what cats eat
    assert v2["results"][0]["relevance_score"] > v2["results"][1]["relevance_score"]


def test_v2_embed_answers_cohere_s_shape_with_each_type_asked_for(server):
    texts = [PAIR_QUERY, PAIR_DOCUMENTS[0]]
    reference = embedded(server, texts)
    status, answer = post(server, "/v2/embed", {"texts": texts, "input_type": "search_query",
                                                "embedding_types": ["float", "base64", "ubinary", "binary"]})
    assert status == 200, answer
    assert answer["response_type"] == "embeddings_by_type" and answer["texts"] == texts
    assert answer["meta"]["billed_units"]["input_tokens"] > len(texts)
    embeddings = answer["embeddings"]
    assert np.allclose(embeddings["float"], reference, atol=1e-6)
    decoded = [np.frombuffer(__import__("base64").b64decode(value), dtype="<f4") for value in embeddings["base64"]]
    assert np.allclose(decoded, reference, atol=1e-6)
    bits = [np.packbits(row > 0).tolist() for row in reference]  # 384 dimensions: 48 bytes
    assert embeddings["ubinary"] == bits and len(bits[0]) == 48
    assert embeddings["binary"] == [[value - 128 for value in row] for row in bits]
    # Without embedding_types: float only, the others left out.
    status, answer = post(server, "/v2/embed", {"texts": texts})
    assert status == 200 and list(answer["embeddings"]) == ["float"]


@pytest.mark.parametrize("body, param, words", [
    ({"texts": ["a"], "embedding_types": ["int8"]}, "embedding_types", "int8 and uint8 need Cohere's calibration"),
    ({"texts": ["a"], "max_tokens": 4}, "max_tokens", "only truncate START"),
    ({"texts": ["a"], "output_dimension": 64}, "output_dimension", "not a Matryoshka model"),
    ({"texts": ["fine", "word " * 300], "truncate": "END"}, "texts[1]", "more than max_model_len (256)"),
    ({"texts": []}, "texts", "at least 1"),
])
def test_v2_embed_refuses_what_it_does_not_build_naming_the_field(server, body, param, words):
    status, answer = post(server, "/v2/embed", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer


def test_v2_embed_truncate_start_keeps_the_last_max_tokens(server):
    status, answer = post(server, "/v2/embed", {"texts": ["word " * 300], "truncate": "START", "max_tokens": 20})
    assert status == 200 and answer["meta"]["billed_units"]["input_tokens"] == 20, answer


def test_invocations_routes_pooling_bodies_by_their_fields(server):
    status, direct = post(server, "/v1/embeddings", {"input": SENTENCES[:2]})
    status, invoked = post(server, "/invocations", {"input": SENTENCES[:2]})
    assert status == 200 and invoked["object"] == "list"
    assert [d["embedding"] for d in invoked["data"]] == [d["embedding"] for d in direct["data"]]
    status, answer = post(server, "/invocations", {"queries": PAIR_QUERY, "documents": PAIR_DOCUMENTS})
    assert status == 200 and [item["object"] for item in answer["data"]] == ["score"] * 3
    status, answer = post(server, "/invocations", {"query": PAIR_QUERY, "documents": PAIR_DOCUMENTS})
    assert status == 200 and answer["results"][0]["index"] == 0
    # `prompt` goes to /v1/completions, which a pooling model refuses (naming the model), as there.
    status, answer = post(server, "/invocations", {"prompt": "Hello"})
    assert status == 400 and answer["error"]["param"] == "model", answer
