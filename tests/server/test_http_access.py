"""The HTTP edge in-process (Quart's test client over a started AsyncEngine on the tiny Llama): the API
key on every route but /health, /metrics and /version (endpoint plugins' routes included), JSON-only
POSTs (415), CORS with --allowed-origins, X-Request-Id checks, 500s that name only a request id, the
warning for a non-loopback bind without a key, and serve's --help."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

import pytest

from asyncengine import AsyncEngine
from asyncengine.interfaces.endpoint import EndpointPlugin
from asyncengine.server.app import create_app
from asyncengine.errors import ConfigError
from asyncengine.server.config import ServerConfig, server_config_from_dict

pytestmark = pytest.mark.anyio

KEY = "secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
ORIGIN = "http://localhost:3000"


@pytest.fixture
def anyio_backend(request):
    # QuartTrio runs on trio only; the loop guard as in tests/conftest.py.
    from support.loop_guard import LoopBlockingGuard

    guard = LoopBlockingGuard()
    request.node.loop_guard = guard
    return ("trio", {"instruments": [guard]})


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")  # built here, in a sync fixture: building blocks the event loop


class PluginRoutes(EndpointPlugin):
    """An endpoint plugin with a GET route, a POST route, and a route that fails with internals in its error."""

    name = "http_access_test"

    def attach(self, app) -> None:
        @app.get("/plugin/hello")
        async def hello():
            return {"hello": "plugin"}

        @app.post("/plugin/echo")
        async def echo():
            from quart import request

            return await request.get_json()

        @app.get("/plugin/broken")
        async def broken():
            raise KeyError("/secret/path/to/weights.safetensors")


@asynccontextmanager
async def serving(llama, **options):
    async with AsyncEngine.start(model=str(llama.path), skip_tokenizer_init=True, max_model_len=128,
                                 kv_cache_memory_bytes=8 * 2**20) as engine:
        engine.plugins.endpoints = [PluginRoutes()]  # as if --plugins named it
        app = create_app(engine, ServerConfig(**options))
        async with app.test_app() as running:
            yield app, running.test_client()


def routes_of(app) -> list[tuple[str, str]]:
    return sorted((rule.rule, method) for rule in app.url_map.iter_rules()
                  for method in (rule.methods or set()) - {"HEAD", "OPTIONS"} if rule.endpoint != "static")


async def test_the_api_key_covers_every_route_but_health_metrics_and_version(llama):
    # vLLM's --api-key k1 --api-key k2: any of the keys is accepted
    async with serving(llama, api_key=["second-key", KEY]) as (app, client):
        routes = routes_of(app)
        assert ("/tokenize", "POST") in routes and ("/plugin/hello", "GET") in routes  # what main left open
        open_routes = []
        for rule, method in routes:
            response = await client.open(rule, method=method, json={} if method == "POST" else None)
            if response.status_code != 401:
                open_routes.append((method, rule, response.status_code))
            else:
                error = (await response.get_json())["error"]
                assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]
        # (and SageMaker's /ping, GET and POST, and the /docs page: static, the contract it reads is behind the key)
        assert sorted(open_routes) == [("GET", "/docs", 200), ("GET", "/health", 200), ("GET", "/metrics", 200),
                                       ("GET", "/ping", 200), ("GET", "/version", 200), ("POST", "/ping", 200)]
        # With the key: served (the plugin's routes too).
        response = await client.get("/plugin/hello", headers=AUTH)
        assert response.status_code == 200 and await response.get_json() == {"hello": "plugin"}
        for token, status in (("second-key", 200), ("second-key" + KEY, 401), ("", 401)):
            response = await client.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
            assert response.status_code == status, token
        response = await client.post("/tokenize", headers=AUTH, json={"prompt": "hi"})
        assert response.status_code == 400  # past the key: no tokenizer here (skip_tokenizer_init)
        assert (await response.get_json())["error"]["code"] == "no_tokenizer"


@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded"])
async def test_a_post_that_is_not_application_json_is_a_415(llama, content_type):
    body = b'{"prompt": [5, 6, 7], "max_tokens": 2}'
    headers = {"Content-Type": content_type} if content_type else {}
    async with serving(llama) as (_, client):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/plugin/echo"):
            response = await client.post(path, data=body, headers=headers)
            assert response.status_code == 415, (path, await response.get_data())
            error = (await response.get_json())["error"]
            assert error["code"] == "unsupported_media_type" and "Content-Type: application/json" in error["message"]
            assert set(error) == {"message", "type", "param", "code"}
        # application/json, with a charset too, is served.
        for given in ("application/json", "application/json; charset=utf-8"):
            response = await client.post("/v1/completions", data=body, headers={"Content-Type": given})
            assert response.status_code == 200, await response.get_data()


async def test_without_allowed_origins_there_are_no_cors_headers(llama):
    async with serving(llama) as (_, client):
        preflight = await client.options("/v1/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        assert "Access-Control-Allow-Origin" not in preflight.headers
        response = await client.post("/v1/completions", json=COMPLETION, headers={"Origin": ORIGIN})
        assert response.status_code == 200 and "Access-Control-Allow-Origin" not in response.headers


async def test_allowed_origins_answer_preflights_and_mark_responses(llama):
    async with serving(llama, api_key=KEY, allowed_origins=[ORIGIN]) as (_, client):
        preflight = await client.options("/v1/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 204  # no key needed: browsers send preflights without credentials
        assert preflight.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
        assert {"authorization", "content-type"} <= {
            h.strip().lower() for h in preflight.headers["Access-Control-Allow-Headers"].split(",")}
        response = await client.post("/v1/completions", json=COMPLETION, headers={"Origin": ORIGIN, **AUTH})
        assert response.status_code == 200
        assert response.headers["Access-Control-Allow-Origin"] == ORIGIN and "Origin" in response.headers["Vary"]
        # An error response carries it too, so the page can read the error.
        response = await client.post("/v1/completions", json=COMPLETION, headers={"Origin": ORIGIN})
        assert response.status_code == 401 and response.headers["Access-Control-Allow-Origin"] == ORIGIN
        # Another origin: refused, and nothing that would let a browser read a response.
        other = await client.options("/v1/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert other.status_code == 403 and "Access-Control-Allow-Origin" not in other.headers
        assert (await other.get_json())["error"]["code"] == "origin_not_allowed"
        response = await client.post("/v1/completions", json=COMPLETION,
                                     headers={"Origin": "http://evil.example", **AUTH})
        assert "Access-Control-Allow-Origin" not in response.headers


def test_allowed_origins_must_be_origins():
    assert server_config_from_dict({"allowed_origins": ["*", "https://a.example:8443"]}).allowed_origins
    for bad in ("localhost:3000", "http://a.example/", "http://a.example/app"):
        with pytest.raises(ConfigError, match="is not an origin"):
            server_config_from_dict({"allowed_origins": [bad]})


async def test_a_request_id_is_printable_ascii_of_bounded_length(llama):
    async with serving(llama) as (_, client):
        response = await client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "job-42.a_b"})
        assert response.status_code == 200 and response.headers["X-Request-Id"] == "job-42.a_b"
        assert (await response.get_json())["id"] == "cmpl-job-42.a_b"
        # é sent as UTF-8 bytes: Quart reads header bytes as latin-1, so main echoed 'Ã©'.
        for bad in ("caf\u00c3\u00a9", "a b", "x" * 129):
            response = await client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": bad})
            assert response.status_code == 400, bad
            error = (await response.get_json())["error"]
            assert error["param"] == "X-Request-Id" and error["code"] == "invalid_request_id"
            assert "printable ASCII" in error["message"]
            assert response.headers["X-Request-Id"] != bad  # the server's own id, which the log line names
        response = await client.post("/v1/completions", json=COMPLETION)  # no id: the server makes one
        assert response.status_code == 200 and len(response.headers["X-Request-Id"]) == 24


async def test_a_500_names_only_the_request_id_and_the_log_has_the_traceback(llama, caplog):
    async with serving(llama) as (_, client):
        with caplog.at_level(logging.ERROR, logger="asyncengine.server"):
            response = await client.get("/plugin/broken", headers={"X-Request-Id": "boom-1"})
        assert response.status_code == 500
        error = (await response.get_json())["error"]
        # main at 3fd5b13: "internal error: KeyError: '/secret/path/to/weights.safetensors'"
        assert error["message"] == "internal error (request id boom-1)"
        assert "secret" not in (await response.get_data(as_text=True))
        assert error["type"] == "internal_error"
        (record,) = [r for r in caplog.records if "boom-1" in r.getMessage()]
        assert record.exc_info and record.exc_info[0] is KeyError
        # ... and the server goes on serving.
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_disable_log_requests_leaves_out_the_line_per_request(llama, caplog):
    from asyncengine.server.app import REQUEST_LOGGER

    async with serving(llama, disable_log_requests=True) as (_, client):
        with caplog.at_level(logging.INFO, logger=REQUEST_LOGGER):
            assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert [r.getMessage() for r in caplog.records if r.name == REQUEST_LOGGER] == []


def test_binding_a_non_loopback_address_without_a_key_warns():
    from asyncengine.server.run import exposure_warning

    warning = exposure_warning(ServerConfig(host="0.0.0.0", api_key=None))
    assert warning.startswith("serving on 0.0.0.0 without an API key")
    assert exposure_warning(ServerConfig(host="::", api_key=None))
    assert exposure_warning(ServerConfig(host="my-host.example", api_key=None))
    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
        assert exposure_warning(ServerConfig(host=host, api_key=None)) is None, host
    assert exposure_warning(ServerConfig(host="0.0.0.0", api_key="k")) is None


def test_serve_help_gives_its_own_default_for_in_process(capsys):
    from asyncengine.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    # main said True; serve runs it apart
    assert "--in-process, --no-in-process Run the engine core in the caller's process (serve: its own). (default: " \
           "False)" in help_text
    assert "--keep-alive-timeout KEEP_ALIVE_TIMEOUT Seconds an idle keep-alive connection stays open. (default: " \
           "5.0)" in help_text
