"""SageMaker's /ping and /invocations, and the /docs page (issue 32, point 7), on the suite's shared server (the
default model, an API key: tests/server/conftest.py).

/invocations answers as the route the body's fields choose: the same greedy text as /v1/chat/completions and
/v1/completions, streamed too. /ping answers as /health, by GET and POST, without the key or a JSON content
type (SageMaker's probe sends neither). /docs is one HTML page that fetches nothing but this server's
/openapi.json: no CDN. The pooling bodies of /invocations are tests/pooling's (a pooling model).
"""

from __future__ import annotations

import http.client
import json
import re
import urllib.parse

import pytest

from asyncengine.server.invocations import invocation_view
from support.server import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4,
        "temperature": 0}
COMPLETION = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


def send(server, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
    url = urllib.parse.urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.headers, response.read()  # (headers by any case)
    finally:
        connection.close()


def post(server, path: str, body: dict) -> tuple[int, dict]:
    status, _, answer = send(server, "POST", path, json.dumps(body).encode(), AUTH)
    return status, json.loads(answer)


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_as_health_without_the_key_or_a_json_body(smol_server, method):
    status, _, body = send(smol_server, method, "/ping", b"" if method == "POST" else None,
                           {"Content-Type": "text/plain"} if method == "POST" else {})
    assert (status, body) == (200, b"")
    assert send(smol_server, "GET", "/health")[0] == 200


def test_invocations_answers_chat_and_completions_as_their_routes(smol_server):
    for route, body in [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]:
        status, direct = post(smol_server, route, body)
        assert status == 200, direct
        status, invoked = post(smol_server, "/invocations", body)
        assert status == 200, invoked
        assert invoked["object"] == direct["object"] and invoked["choices"] == direct["choices"], route


def test_invocations_streams_as_the_chosen_route(smol_server):
    status, headers, body = send(smol_server, "POST", "/invocations", json.dumps({**CHAT, "stream": True}).encode(),
                                 AUTH)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    _, direct = post(smol_server, "/v1/chat/completions", CHAT)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
        direct["choices"][0]["message"]["content"]


def test_invocations_errors_are_the_chosen_route_s_or_name_the_fields_it_chooses_by(smol_server):
    status, answer = post(smol_server, "/invocations", {**CHAT, "max_tokens": -1})  # the chat route's 400
    assert status == 400 and answer["error"]["param"] == "max_tokens", answer
    status, answer = post(smol_server, "/invocations", {"model": MODEL_NAME, "max_tokens": 4})
    assert status == 400 and "found none of them" in answer["error"]["message"], answer
    for raw in (b"[1, 2]", b"{not json", b""):
        status, _, body = send(smol_server, "POST", "/invocations", raw, AUTH)
        assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error", (raw, body)
    status, _, _ = send(smol_server, "POST", "/invocations", json.dumps(CHAT).encode(),
                        {"Content-Type": "application/json"})
    assert status == 401  # it runs the engine: the key is asked for, as on /v1


@pytest.mark.parametrize("body, view", [
    ({"messages": [], "prompt": "x", "input": "y"}, "chat_completions"),  # vLLM's order: chat first
    ({"prompt": "x", "input": "y"}, "completions"),
    ({"input": "x"}, "embeddings"),
    ({"text_1": "a", "text_2": "b"}, "score"),
    ({"queries": "a", "documents": ["b"]}, "score"),  # a score pair before rerank's query/documents
    ({"query": "a", "documents": ["b"]}, "rerank"),
])
def test_invocation_view_chooses_by_the_fields_in_vllms_order(body, view):
    assert invocation_view(json.dumps(body).encode(), "embed") == view
    if view == "embeddings":
        assert invocation_view(json.dumps(body).encode(), "classify") == "classify"


def test_invocation_view_refuses_a_body_nested_too_deep_to_choose_by_naming_the_field():
    # (msgspec recurses even to skip a raw value: a RecursionError, found by tests/server/test_fuzz.py as a 500)
    from asyncengine.server.errors import ApiError

    with pytest.raises(ApiError) as caught:
        invocation_view(b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "embed")
    assert (caught.value.status, caught.value.param) == (400, "messages")
    assert "nests JSON arrays or objects too deeply" in caught.value.message


def test_docs_is_a_self_contained_page_of_the_contract(smol_server):
    status, headers, body = send(smol_server, "GET", "/docs")  # no key: the page itself holds nothing secret
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    page = body.decode()
    # Nothing loaded from elsewhere: no external script, style, font or fetch; the CSP forbids them anyway.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "cdn" not in page.lower() and "@import" not in page
    assert "fetch(base + \"openapi.json\"" in page
    assert "connect-src 'self'" in headers["Content-Security-Policy"]
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert "innerHTML" not in page  # the document is written as text, never parsed as HTML
    # What the page reads: the contract, with the new routes in it (behind the key).
    assert send(smol_server, "GET", "/openapi.json")[0] == 401
    status, _, document = send(smol_server, "GET", "/openapi.json", headers=AUTH)
    paths = json.loads(document)["paths"]
    for path in ("/v1/score", "/v2/rerank", "/v2/embed", "/ping", "/invocations", "/docs"):
        assert path in paths, path
    assert set(paths["/ping"]) == {"get", "post"}
