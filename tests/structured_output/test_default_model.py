"""Structured outputs on the default model (SmolLM2-135M-Instruct, float32), batched in-process, for each
backend: seeded JSON schemas parse and validate (jsonschema) and finish with "stop"; regex, choice and
a grammar match; async scheduling on and off give the same tokens under greedy decoding.

The suite runs the first 10 schemas; `bench/structured.py --validate-all` checks all 50 for each backend.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from asyncengine import LLM, SamplingParams, StructuredOutputsParams
from structured_output.schemas import SCHEMAS

BACKENDS = ("xgrammar", "guidance")
NUM_IN_SUITE = 10

GRAMMARS = {  # one arithmetic grammar in each backend's language (bounded: a sum of two numbers)
    "xgrammar": 'root ::= num " " op " " num\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"',
    "guidance": 'start: num " " op " " num\nnum: /[1-9][0-9]?/\nop: "+" | "-" | "*"',
}
ARITHMETIC = re.compile(r"[1-9][0-9]? [+*-] [1-9][0-9]?")


@pytest.fixture(scope="module")
def llm(default_model_dir):
    with LLM(str(default_model_dir), dtype="float32", max_num_seqs=64) as engine:
        yield engine


def ask(schema: dict) -> list[dict]:
    return [{"role": "user", "content": f"Write one example JSON document for this schema: {json.dumps(schema)}"}]


def check_schemas(llm, schemas: list[dict], backend: str) -> None:
    params = [SamplingParams(temperature=0, max_tokens=256,
                             structured_outputs=StructuredOutputsParams(json=schema, backend=backend))
              for schema in schemas]
    outputs = llm.chat([ask(schema) for schema in schemas], params)
    failures = []
    for index, (schema, output) in enumerate(zip(schemas, outputs)):
        completion = output.outputs[0]
        try:
            jsonschema.validate(json.loads(completion.text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append((index, completion.finish_reason, completion.text[:200], str(exc)[:200]))
            continue
        if completion.finish_reason != "stop":
            failures.append((index, completion.finish_reason, completion.text[:200], "did not stop"))
    assert not failures, failures


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_schemas_validate(llm, backend):
    check_schemas(llm, SCHEMAS[:NUM_IN_SUITE], backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_choice_grammar_and_json_object(llm, backend):
    def constrained(**fields):
        return SamplingParams(temperature=0.7, seed=3, max_tokens=64,
                              structured_outputs=StructuredOutputsParams(backend=backend, **fields))

    outputs = llm.chat([[{"role": "user", "content": text}] for text in
                        ("Give an email address", "Is the sky green?", "Write a sum", "A person as JSON")], [
        constrained(regex=r"[a-z]{2,10}@[a-z]{2,8}\.(com|org)"),
        constrained(choice=["yes", "no", "maybe not"]),
        constrained(grammar=GRAMMARS[backend]),
        SamplingParams(temperature=0, max_tokens=256,
                       structured_outputs=StructuredOutputsParams(json_object=True, backend=backend)),
    ])
    email, answer, arithmetic, document = (output.outputs[0] for output in outputs)
    assert re.fullmatch(r"[a-z]{2,10}@[a-z]{2,8}\.(com|org)", email.text), email.text
    assert answer.text in ("yes", "no", "maybe not"), answer.text
    assert ARITHMETIC.fullmatch(arithmetic.text), arithmetic.text
    # Any JSON object is unbounded: the model may still be writing it at max_tokens. What it wrote is an object.
    assert document.text.startswith("{"), document.text
    if document.finish_reason == "stop":
        assert isinstance(json.loads(document.text), dict), document.text
    assert all(c.finish_reason == "stop" for c in (email, answer, arithmetic))


@pytest.mark.slow
def test_async_scheduling_on_and_off_give_the_same_constrained_tokens(llm, default_model_dir):
    """Mixed batch: constrained requests (both backends) among unconstrained ones, greedy."""
    prompts = [ask(schema) for schema in SCHEMAS[:4]] + [[{"role": "user", "content": "Tell me a story"}]] * 2
    params = [SamplingParams(temperature=0, max_tokens=128,
                             structured_outputs=StructuredOutputsParams(json=schema, backend=BACKENDS[i % 2]))
              for i, schema in enumerate(SCHEMAS[:4])] + [SamplingParams(temperature=0, max_tokens=40)] * 2
    with_async = [list(o.outputs[0].token_ids) for o in llm.chat(prompts, params)]
    with LLM(str(default_model_dir), dtype="float32", async_scheduling=False) as sync_llm:
        without = [list(o.outputs[0].token_ids) for o in sync_llm.chat(prompts, params)]
    assert with_async == without
