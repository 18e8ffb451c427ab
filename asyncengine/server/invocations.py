"""SageMaker's POST /invocations: one route for every API, the body's shape choosing which, as vLLM chooses.

vLLM tries its request types in order (chat, completions, embeddings or classification, score, rerank) and
takes the first the body validates as. Here the choice is by the field that makes each type what it is, in
the same order, so that a body with a wrong value in it is answered by the route it was meant for (its 400
names the field) rather than falling through to another:

| the body has | route |
|---|---|
| `messages` | /v1/chat/completions |
| `prompt` | /v1/completions |
| `input` | /v1/embeddings, or /classify when the model is a classifier |
| one of the score pairs (`text_1`/`text_2`, `queries`/`documents`, ...) | /score |
| `query` and `documents` | /rerank |

Only the body's top level is parsed to choose (its values stay raw bytes): the chosen route decodes it all.
"""

from __future__ import annotations

import msgspec

from asyncengine.server.errors import bad_request, too_deep
from asyncengine.server.protocol_pooling import SCORE_PAIRS

# The view names (routes.py, serving_pooling.POOLING_ROUTES) an invocation can reach.
INVOCATION_VIEWS = ("chat_completions", "completions", "embeddings", "classify", "score", "rerank")


def invocation_view(body: bytes, pooling_task: str | None) -> str:
    """The view that answers an /invocations `body`; `pooling_task`: the model's default pooling task
    ("embed", "classify"), None when it has none. A 400 when the body is no JSON object or has none of
    the fields that choose."""
    if not body:
        raise bad_request("the request has no body: send a JSON object", code="invalid_json")
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError as error:
        raise bad_request(f"/invocations takes a JSON object: {error}", code="invalid_value") from error
    except msgspec.DecodeError as error:
        raise bad_request(f"the request body is not valid JSON: {error}", code="invalid_json") from error
    except RecursionError as error:  # (skipping a raw value recurses too) as the routes' own decoding says it
        raise too_deep(body) from error
    if "messages" in fields:
        return "chat_completions"
    if "prompt" in fields:
        return "completions"
    if "input" in fields:
        return "classify" if pooling_task == "classify" else "embeddings"
    if any(first in fields and second in fields for first, second in SCORE_PAIRS):
        return "score"
    if "query" in fields and "documents" in fields:
        return "rerank"
    pairs = ", ".join(f"{a}/{b}" for a, b in SCORE_PAIRS)
    raise bad_request("/invocations chooses its API by the body's fields and found none of them: send `messages` "
                      "(chat), `prompt` (completions), `input` (embeddings, or classification on a classifier), "
                      f"a score pair ({pairs}) or `query` and `documents` (rerank)", code="missing_parameter")
