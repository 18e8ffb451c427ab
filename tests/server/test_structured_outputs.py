"""Structured outputs through the real server with the official `openai` client (issue 16): seeded JSON
schemas as `response_format` json_schema, streamed, parse and validate; vLLM's `structured_outputs` extra
body on completions; a bad schema or regex is a 400 naming the field and the backend."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from structured_output.schemas import SCHEMAS
from support.server import API_KEY, MODEL_NAME

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(smol_server):
    with openai.OpenAI(base_url=smol_server.base_url, api_key=API_KEY, max_retries=0, timeout=600) as client:
        yield client


@pytest.mark.parametrize("seed", range(5))
def test_a_streamed_json_schema_response_validates(client, seed):
    schema = SCHEMAS[seed]
    stream = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=256, stream=True,
        messages=[{"role": "user", "content": f"Write one example JSON document for this schema: {json.dumps(schema)}"}],
        response_format={"type": "json_schema", "json_schema": {"name": f"s{seed}", "schema": schema, "strict": True}})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    jsonschema.validate(json.loads(text), schema)
    assert finish == "stop"


def test_the_structured_outputs_extra_body_on_completions(client):
    completion = client.completions.create(model=MODEL_NAME, prompt="My phone number is", max_tokens=32,
                                           temperature=0.8, seed=5,
                                           extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", completion.choices[0].text)
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param, backend", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                         "minProperties": "x"}}}},
     "structured_outputs.json", "xgrammar"),
    ({"structured_outputs": {"regex": "(a", "backend": "guidance"}}, "structured_outputs.regex", "guidance"),
])
def test_a_refused_grammar_is_a_400_naming_the_field_and_the_backend(client, body, param, backend):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       extra_body=body)
    error = refused.value.body
    assert error["param"] == param and f"backend {backend!r}" in error["message"], error
