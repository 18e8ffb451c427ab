"""schemathesis against a real `asyncengine serve` and its own GET /openapi.json (issue 30, acceptance 4).

Every operation the document lists (the runtime LoRA routes included) is called with the request examples
the document gives (what a client would send: a completion, a stream, logprobs, a JSON schema, embeddings,
...), then with bodies schemathesis draws from the document: `POSITIVE_EXAMPLES` valid ones (each field
within the bounds the document states) and, for operations with a body, `NEGATIVE_EXAMPLES` invalid ones (a
bound broken, a required field missing, a wrong type, an unknown field, no API key), derandomized, without
shrinking. Each answer goes through schemathesis' checks:

- not_a_server_error: no 5xx (a 503 is an overload or a dead engine: none here);
- status_code_conformance and content_type_conformance: the status and the media type are documented;
- response_schema_conformance: the body matches the documented schema (a stream: every server-sent event
  matches the operation's itemSchema, its `data` the chunk or ErrorResponse schema, or `[DONE]`);
- response_headers_conformance: the documented headers;
- negative_data_rejection: a body the document calls invalid is refused with a 4xx (so every bound the
  document states is enforced, and the other way round test_openapi.py checks the bounds against SamplingParams).

The server: the default model with small limits, so that a valid request generates little (a 64-token
context, --max-n 2, --max-logprobs 2), LoRA enabled with runtime updates, an API key. The hand-made extremes
(nesting 10,000 deep, numbers past int64, megabyte strings, adapters that do and do not fit, concurrent pairs)
stay in test_fuzz.py. Suite time: the server's start and about 200 requests (about 40 s on a quiet machine).
"""

from __future__ import annotations

import collections
import json
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance, negative_data_rejection, response_headers_conformance, response_schema_conformance,
    status_code_conformance,
)

from support.server import start_server

API_KEY = "schemathesis-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVER_OPTIONS = ["--served-model-name", "smol", "--api-key", API_KEY, "--max-model-len", "64", "--max-n", "2",
                  "--max-logprobs", "2", "--max-num-seqs", "8", "--max-waiting-requests", "64",
                  "--kv-cache-memory-bytes", str(64 * 2**20), "--enable-lora", "--max-lora-rank", "8",
                  "--max-loras", "1", "--enable-runtime-lora-updates"]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
POSITIVE_EXAMPLES = 5
NEGATIVE_EXAMPLES = 3
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE


@pytest.fixture(scope="module")
def server(default_model_dir):
    running = start_server([str(default_model_dir), *SERVER_OPTIONS])
    yield running
    assert running.stop() == 0, running.stderr()[-3000:]


def run_schemathesis(url: str) -> tuple[list[str], list[str], collections.Counter, set[str]]:
    """(operations, failures, statuses by (operation, mode, status), the operations with a body) of schemathesis
    against the server at `url`."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=AUTH, timeout=60)
    failures: list[str] = []
    statuses: collections.Counter = collections.Counter()
    operations = []
    with_body: set[str] = set()

    def test_of(operation, mode: str, strategy, examples: int):
        @settings(max_examples=examples, derandomize=True, database=None, deadline=None, print_blob=False,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def call(case):
            response = case.call(base_url=url, headers=AUTH, timeout=600)  # (a hang fails by the test's timeout)
            statuses[(operation.label, mode, response.status_code)] += 1
            try:
                case.validate_response(response, checks=CHECKS)
            except FailureGroup as group:  # recorded, so that one run reports every operation's failures
                failures.append(f"{operation.label} ({mode}): {group}\n  "
                                f"{case.as_curl_command(headers=AUTH)}\n  -> {response.status_code} "
                                f"{response.content[:400]!r}")

        return call

    for result in schema.get_all_operations():
        operation = result.ok()  # raises on an operation schemathesis cannot read
        operations.append(operation.label)
        for example in schema.get_strategies_from_examples(operation):
            test_of(operation, "examples", example, 1)()
        test_of(operation, "positive", operation.as_strategy(generation_mode=POSITIVE), POSITIVE_EXAMPLES)()
        if operation.body:  # (a GET without parameters, or a POST that reads no body, has nothing to break)
            with_body.add(operation.label)
            test_of(operation, "negative", operation.as_strategy(generation_mode=NEGATIVE), NEGATIVE_EXAMPLES)()
    return operations, failures, statuses, with_body




@pytest.mark.timeout(900)  # about 40 s on a quiet machine; a busy one can take ten times that
def test_schemathesis_finds_no_server_error_and_no_schema_violation(server):
    operations, failures, statuses, with_body = run_schemathesis(server.url)
    summary: collections.Counter = collections.Counter()  # requests by (operation, mode)
    for (label, mode, _), count in statuses.items():
        summary[(label, mode)] += count
    print(f"\n{sum(statuses.values())} requests over {len(operations)} operations; statuses {dict(statuses)}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])
    # Every operation was called, each with a body in both modes, and the LoRA routes are among them.
    assert {"POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter", "POST /v1/chat/completions"} <= set(
        operations)
    uncalled = [(label, mode) for label in operations for mode in ("positive", "negative")
                if (mode == "positive" or label in with_body) and not summary[(label, mode)]]
    assert not uncalled, (uncalled, summary)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses"} <= with_body
    # The document's examples were served, not refused: generation (streams included), embeddings, ranking.
    for label in ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/chat/completions/render",
                  "POST /tokenize", "POST /detokenize", "POST /v1/embeddings", "POST /score", "POST /rerank"):
        assert statuses[(label, "examples", 200)] == summary[(label, "examples")] > 0, (label, dict(statuses))
    with urllib.request.urlopen(urllib.request.Request(server.url + "/v1/models", headers=AUTH)) as answer:
        assert json.loads(answer.read())["data"][0]["id"] == "smol"  # and the server serves on
