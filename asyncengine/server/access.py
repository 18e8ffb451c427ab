"""Who may call the API, and how: the API key, the request's content type, CORS, the request id.

The checks of every request before its route runs (`check_request`) and the headers every response
gets (`finish_response`); create_app installs them as Quart hooks. docs/server.md ("Access") is the
user's description.

- `--api-key` covers every route, endpoint plugins' included, except PUBLIC_PATHS (probes and
  scrapers that carry no key) and CORS preflights (a browser sends those without credentials).
- A POST must say `Content-Type: application/json`: a web page can POST `text/plain` (or a form) to a
  server on localhost without a CORS preflight, so accepting those would let any page a user visits
  drive the server; a 415 otherwise.
- CORS is off unless `--allowed-origins` names origins (or `*`): then a preflight from one of them is
  answered, and responses to it carry Access-Control-Allow-Origin.
- `X-Request-Id` becomes the engine's request id and is echoed in a header, so it must be a header
  value that survives the round trip and a log line: printable ASCII, at most MAX_REQUEST_ID_LENGTH
  characters; anything else is a 400 naming the header (not silently replaced: the client would then
  look for its id in the logs and never find it).
"""

from __future__ import annotations

import hmac
import secrets

from quart import Response, g, request

from asyncengine.server.config import ServerConfig
from asyncengine.server.errors import ApiError

# /docs is a static page: the contract it shows comes from /openapi.json, which asks for the key.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/docs"})
# POST routes that read no body (SageMaker's health check POSTs to /ping with whatever content type).
BODYLESS_POSTS = frozenset({"/ping"})
MAX_REQUEST_ID_LENGTH = 128
JSON_METHODS = frozenset({"POST", "PUT", "PATCH"})
CORS_ALLOWED_METHODS = "GET, POST, OPTIONS"
CORS_ALLOWED_HEADERS = "Authorization, Content-Type, X-Request-Id"
CORS_MAX_AGE_SECONDS = 600


def check_request(config: ServerConfig) -> Response | None:
    """Before the route: a preflight answered here, or None to go on; ApiError when refused."""
    g.request_id, id_problem = _request_id(request.headers.get("X-Request-Id"))
    if _is_preflight():
        return _preflight_response(config)
    if config.api_key and request.path not in PUBLIC_PATHS and request.method != "OPTIONS" \
            and not _authorized(config.api_keys):
        raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                       type="authentication_error", code="invalid_api_key")
    if id_problem:
        raise ApiError(400, id_problem, param="X-Request-Id", code="invalid_request_id")
    if request.method in JSON_METHODS and request.url_rule is not None and request.mimetype != "application/json" \
            and request.path not in BODYLESS_POSTS:
        given = request.headers.get("Content-Type")
        raise ApiError(415, f"{request.method} {request.path} takes a JSON body: send 'Content-Type: application/json' "
                            f"(got {repr(given) if given else 'no Content-Type'})",
                       code="unsupported_media_type")
    return None


def finish_response(response: Response, config: ServerConfig) -> Response:
    """Every response: its request id, and CORS headers for an allowed origin."""
    response.headers["X-Request-Id"] = getattr(g, "request_id", "")
    origin = request.headers.get("Origin")
    if config.allowed_origins and origin is not None and _origin_allowed(origin, config):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = "X-Request-Id, X-Ignored-Fields"
        response.vary.add("Origin")
    return response


def _request_id(given: str | None) -> tuple[str, str | None]:
    """The request's id, and what is wrong with the one the client gave (None when nothing is)."""
    if given is None or given == "":
        return secrets.token_hex(12), None
    if len(given) > MAX_REQUEST_ID_LENGTH or not all("!" <= character <= "~" for character in given):
        # Quart decodes header bytes as latin-1, so a UTF-8 id arrives as several characters here.
        return secrets.token_hex(12), (
            f"X-Request-Id must be printable ASCII without spaces, at most {MAX_REQUEST_ID_LENGTH} characters "
            f"(got {len(given.encode('latin-1', 'replace'))} bytes): send such an id, or none and the server "
            "makes one")
    return given, None


def _is_preflight() -> bool:
    return (request.method == "OPTIONS" and "Origin" in request.headers
            and "Access-Control-Request-Method" in request.headers)


def _preflight_response(config: ServerConfig) -> Response | None:
    if not config.allowed_origins:
        return None  # CORS off: Quart's plain OPTIONS answer, without CORS headers, so browsers refuse
    origin = request.headers["Origin"]
    if not _origin_allowed(origin, config):
        raise ApiError(403, f"origin {origin!r} is not allowed: the server's --allowed-origins does not name it",
                       code="origin_not_allowed")
    return Response("", status=204, headers={
        "Access-Control-Allow-Methods": CORS_ALLOWED_METHODS,
        "Access-Control-Allow-Headers": CORS_ALLOWED_HEADERS,
        "Access-Control-Max-Age": str(CORS_MAX_AGE_SECONDS),
    })


def _origin_allowed(origin: str, config: ServerConfig) -> bool:
    return "*" in config.allowed_origins or origin in config.allowed_origins


def _authorized(api_keys: list[str]) -> bool:
    """Whether the request's bearer token is one of the keys (each compared in constant time, all of them)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    given = token.strip().encode()
    matches = [hmac.compare_digest(given, key.encode()) for key in api_keys]
    return scheme.lower() == "bearer" and any(matches)
