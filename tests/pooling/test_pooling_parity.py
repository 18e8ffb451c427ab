"""Acceptance 2 of issue 18: random-weight pooling models match transformers with the same pooling (max abs
error <= 1e-4, float32): decoders as embedders (last token, normalized), a decoder classifier, a BERT encoder
(CLS), a BERT cross-encoder reranker (pairs with segment ids, through /score, /rerank and /classify), and an
XLM-RoBERTa classifier (positions after the padding index). One engine per model, token ids or the
all-MiniLM-L6-v2 tokenizer."""

from __future__ import annotations

import pytest
import torch

from asyncengine.pooling.default_model import default_pooling_model_dir
from asyncengine.pooling.params import PoolingParams
from support.in_process_server import in_process_server
from support.pooling_models import build

PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [7], [300, 12, 55, 2, 9, 14, 77, 101, 6, 33, 81, 19, 4], list(range(20, 60))]
OPTIONS = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=256)
TOKEN_IDS_ONLY = dict(skip_tokenizer_init=True)
TOLERANCE = 1e-4


def _ours(model_dir, task, prompts=PROMPTS, **options):
    from asyncengine import LLM

    with LLM(str(model_dir), **{**OPTIONS, **TOKEN_IDS_ONLY, **options}) as llm:
        assert llm.engine.model_config.runner == "pooling"
        outputs = llm.encode([{"prompt_token_ids": p} for p in prompts], task=task)
        return [o.outputs.data for o in outputs], llm.engine.model_config.pooler


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_a_decoder_embeds_with_its_last_token_as_transformers(tiny_model, name):
    model = tiny_model(name)
    ours, pooler = _ours(model.path, "embed", runner="pooling")
    assert (pooler.pooling_type, pooler.normalize) == ("LAST", True)
    for prompt, got in zip(PROMPTS, ours):
        with torch.no_grad():
            hidden = model.hf_model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(hidden, dim=-1)
        assert (got - expected).abs().max() <= TOLERANCE


def test_a_decoder_classifier_scores_its_last_token_as_transformers(tmp_path):
    model = build("qwen3-classifier", tmp_path)
    ours, pooler = _ours(model.path, "classify")  # runner auto: *ForSequenceClassification is pooling
    assert pooler.pooling_type is None and pooler.is_classifier
    for prompt, got in zip(PROMPTS, ours):
        with torch.no_grad():
            logits = model.hf_model(torch.tensor([prompt])).logits[0]
        assert (got - torch.softmax(logits, -1)).abs().max() <= TOLERANCE


def test_a_bert_encoder_embeds_with_cls_as_transformers(tmp_path):
    model = build("bert", tmp_path)
    ours, pooler = _ours(model.path, "embed")
    assert pooler.pooling_type == "CLS" and pooler.source == "the default for a encoder"
    for prompt, got in zip(PROMPTS, ours):
        with torch.no_grad():
            hidden = model.hf_model(torch.tensor([prompt])).last_hidden_state[0, 0]
        assert (got - torch.nn.functional.normalize(hidden, dim=-1)).abs().max() <= TOLERANCE


def test_xlm_roberta_classifier_as_transformers(tmp_path):
    model = build("xlm-roberta-classifier", tmp_path)
    prompts = [[0, *p, 2] for p in PROMPTS]
    ours, _ = _ours(model.path, "encode", prompts)  # the raw class scores (no activation)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            logits = model.hf_model(torch.tensor([prompt])).logits[0]
        assert (got - logits).abs().max() <= TOLERANCE


QUERY = "what do cats eat?"
DOCUMENTS = ["Cats are carnivores and eat meat.", "The stock market closed higher.", "Cats sleep a lot."]
JSON = {"Content-Type": "application/json"}


def test_a_bert_cross_encoder_reranks_pairs_as_transformers(tmp_path):
    from transformers import AutoTokenizer

    model = build("bert-classifier", tmp_path, tokenizer_from=default_pooling_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(model.path))
    with torch.no_grad():
        expected = [torch.sigmoid(model.hf_model(**tokenizer(QUERY, doc, return_tensors="pt")).logits[0, 0]).item()
                    for doc in DOCUMENTS]
    assert len(set(tokenizer(QUERY, DOCUMENTS[0])["token_type_ids"])) == 2  # the pair's segment ids matter
    with in_process_server({"model": str(model.path), **OPTIONS}) as server:
        status, _, body = server.request("POST", "/score", {"text_1": QUERY, "text_2": DOCUMENTS}, JSON)
        assert status == 200, body
        scores = [item["score"] for item in __import__("json").loads(body)["data"]]
        assert max(abs(a - b) for a, b in zip(scores, expected)) <= TOLERANCE
        status, _, body = server.request("POST", "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS,
                                                               "top_n": 2}, JSON)
        results = __import__("json").loads(body)["results"]
        order = sorted(range(3), key=lambda i: -expected[i])[:2]
        assert status == 200 and [r["index"] for r in results] == order
        assert [r["document"]["text"] for r in results] == [DOCUMENTS[i] for i in order]
        status, _, body = server.request("POST", "/classify", {"input": QUERY}, JSON)
        (item,) = __import__("json").loads(body)["data"]
        assert status == 200 and item["num_classes"] == 1 and 0 < item["probs"][0] < 1
        # vLLM's other names (issue 32): /v1/score with queries/documents, Cohere's /v2/rerank, and SageMaker's
        # /invocations, which sends `input` to /classify on a classifier and a score pair to /score.
        # (Batched differently, the scores agree within the tolerance, not to the bit.)
        status, _, body = server.request("POST", "/v1/score", {"queries": QUERY, "documents": DOCUMENTS}, JSON)
        again = [item["score"] for item in __import__("json").loads(body)["data"]]
        assert status == 200 and max(abs(a - b) for a, b in zip(again, expected)) <= TOLERANCE
        status, _, body = server.request("POST", "/v2/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2},
                                         JSON)
        assert status == 200 and [r["index"] for r in __import__("json").loads(body)["results"]] == order
        status, _, body = server.request("POST", "/invocations", {"input": QUERY}, JSON)
        assert status == 200 and __import__("json").loads(body)["data"][0]["object"] == "classification"
        status, _, body = server.request("POST", "/invocations", {"text_1": QUERY, "text_2": DOCUMENTS}, JSON)
        again = [item["score"] for item in __import__("json").loads(body)["data"]]
        assert status == 200 and max(abs(a - b) for a, b in zip(again, expected)) <= TOLERANCE
        status, _, body = server.request("POST", "/v1/embeddings", {"input": QUERY}, JSON)
        assert status == 400 and b"is a classifier" in body


def test_pooling_params_are_checked_field_by_field():
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be a positive integer or -1"):
        PoolingParams(truncate_prompt_tokens=-2)
    with pytest.raises(ValueError, match="task must be one of embed, classify, score, encode"):
        PoolingParams(task="generate")
