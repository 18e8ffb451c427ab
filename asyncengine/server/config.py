"""ServerConfig: the HTTP server's own options (the engine's are EngineConfig's).

`asyncengine serve` derives one flag per field, as it does for EngineConfig: `api_key` is `--api-key`.
"""

from __future__ import annotations

import os
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec

from asyncengine.config.help import doc
from asyncengine.errors import ConfigError

# vLLM's --uvicorn-log-level values; trace is logging's DEBUG (there is no lower level).
UVICORN_LOG_LEVELS = {"critical": "CRITICAL", "error": "ERROR", "warning": "WARNING", "info": "INFO",
                      "debug": "DEBUG", "trace": "DEBUG"}


class ServerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: Annotated[str, doc("The address to bind; 0.0.0.0 for every interface.")] = "127.0.0.1"
    port: Annotated[int, doc("The port to bind; 0: a free one (printed).")] = 8000
    # Required on every route but /health, /metrics and /version (server/access.py). After __post_init__ a
    # list of keys (or None).
    api_key: Annotated[str | list[str] | None, doc(
        "API key(s) a request must send as 'Authorization: Bearer KEY'; several values or the flag repeated: "
        "any of them; none: $ASYNCENGINE_API_KEY, else no key.")] = None
    max_request_body_bytes: Annotated[int, doc(
        "The largest request body in bytes; a larger one is a 413.")] = 2 * 2**20
    tool_call_parser: Annotated[str | None, doc(
        "The tool-call parser that finds tool calls in the model's text (hermes, ... or a plugin's).")] = None
    enable_auto_tool_choice: Annotated[bool, doc(
        "Let the model decide to call tools (tool_choice auto); needs --tool-call-parser.")] = False
    reasoning_parser: Annotated[str | None, doc(
        "The reasoning parser that separates the model's reasoning from its answer.")] = None
    tool_parser_plugin: Annotated[str | None, doc(
        "A module or .py file that registers tool parsers, loaded before --tool-call-parser is looked up.")] = None
    reasoning_parser_plugin: Annotated[str | None, doc(
        "A module or .py file that registers reasoning parsers.")] = None
    middleware: Annotated[list[str], doc(
        "ASGI middleware, pkg.mod:obj, applied in order; several values or the flag "
        "repeated.")] = msgspec.field(default_factory=list)
    shutdown_grace_period: Annotated[float, doc(
        "Seconds running requests (streams too) may take to finish after SIGINT or SIGTERM.")] = 30.0
    keep_alive_timeout: Annotated[float, doc("Seconds an idle keep-alive connection stays open.")] = 5.0
    # From a request's headers to the end of its body (server/body_deadline.py); 30 s: a 2 MiB body (the
    # default limit) at 70 KB/s.
    request_body_timeout: Annotated[float, doc(
        "Seconds from a request's headers to the end of its body; later: a 408 and the connection "
        "closed.")] = 30.0
    # Exit status 1 lets a supervisor restart the server.
    keep_serving_after_engine_death: Annotated[bool, doc(
        "Keep serving (every request a 503) after the engine dies, instead of exiting with status 1.")] = False
    allowed_origins: Annotated[list[str], doc(
        "Origins (scheme://host[:port]) browsers may call the API from, or *; none: no CORS "
        "headers.")] = msgspec.field(default_factory=list)
    # Also enabled by the environment variable ASYNCENGINE_ALLOW_RUNTIME_LORA_UPDATING=1, as vLLM's.
    enable_runtime_lora_updates: Annotated[bool, doc(
        "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter.")] = False
    # vLLM's request-logging flags, mapped onto the server's request log (app.py).
    enable_log_requests: Annotated[bool, doc(
        "Also log each request's body (its prompt or messages and sampling fields) after its one-line "
        "entry.")] = False
    disable_log_requests: Annotated[bool, doc(
        "Log no line per request (vLLM's older flag).")] = False
    max_log_len: Annotated[int | None, doc(
        "The most characters of a request's body --enable-log-requests logs; none: all.")] = None
    # vLLM names the HTTP server's logging after uvicorn; here it is Hypercorn's (server/run.py).
    uvicorn_log_level: Annotated[str | None, doc(
        "The log level of the HTTP server and of the per-request lines: critical, error, warning, info, debug "
        "or trace (debug); none: --log-level's.")] = None
    # The Responses API's store (server/responses_store.py): bounded, the oldest finished responses evicted.
    responses_store_max_entries: Annotated[int, doc(
        "The most responses the Responses API keeps for GET, previous_response_id and cancel (store: true); "
        "past it the oldest finished ones are evicted; 0: no store.")] = 1000
    responses_store_max_bytes: Annotated[int, doc(
        "The most bytes (as JSON) the stored responses and their conversations take together; past it the "
        "oldest finished ones are evicted.")] = 128 * 2**20

    # docs/server.md, "Fields the server ignores": unknown top-level request fields are ignored (vLLM's way),
    # logged and named in X-Ignored-Fields, unless this makes them a 400.
    strict_request_fields: Annotated[bool, doc(
        "Refuse a request field the server does not know with a 400, instead of ignoring it (logged and named "
        "in the X-Ignored-Fields header).")] = False
    enable_prompt_tokens_details: Annotated[bool, doc(
        "Report usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache served.")] = False
    # vLLM's flag: a request's own chat_template is Jinja code run on the server.
    trust_request_chat_template: Annotated[bool, doc(
        "Let a chat request set its own chat_template (a Jinja template rendered in a sandbox); without it such "
        "a request is a 400.")] = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0..65535, got {self.port}", field="port")
        if self.max_request_body_bytes < 1024:
            raise ConfigError(f"max_request_body_bytes must be at least 1024, got {self.max_request_body_bytes}",
                              field="max_request_body_bytes")
        if self.shutdown_grace_period < 0:
            raise ConfigError("shutdown_grace_period must not be negative", field="shutdown_grace_period")
        if self.keep_alive_timeout <= 0:
            raise ConfigError(f"keep_alive_timeout must be positive (seconds), got {self.keep_alive_timeout}",
                              field="keep_alive_timeout")
        if self.request_body_timeout <= 0:
            raise ConfigError(f"request_body_timeout must be positive (seconds), got {self.request_body_timeout}",
                              field="request_body_timeout")
        for origin in self.allowed_origins:
            parts = urlsplit(origin)
            if origin != "*" and (parts.scheme not in ("http", "https") or not parts.netloc
                                  or parts.path or parts.query or parts.fragment):
                raise ConfigError(f"allowed_origins: {origin!r} is not an origin: give scheme://host[:port] without "
                                  "a path or trailing slash (http://localhost:3000), or *", field="allowed_origins")
        for name in ("responses_store_max_entries", "responses_store_max_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be 0 or more, got {getattr(self, name)}", field=name)
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser NAME", field="tool_call_parser")
        if self.api_key is None:
            self.api_key = os.environ.get("ASYNCENGINE_API_KEY") or None
        keys = [self.api_key] if isinstance(self.api_key, str) else list(self.api_key or [])
        if not all(isinstance(key, str) for key in keys):
            raise ConfigError("api_key must be a key or a list of keys", field="api_key")
        self.api_key = [key for key in keys if key] or None  # an empty key would let an empty token in
        if self.enable_log_requests and self.disable_log_requests:
            raise ConfigError("--enable-log-requests and --disable-log-requests contradict each other: give one",
                              field="enable_log_requests")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ConfigError(f"max_log_len must be 0 or more characters, got {self.max_log_len}", field="max_log_len")
        if self.uvicorn_log_level is not None and self.uvicorn_log_level.lower() not in UVICORN_LOG_LEVELS:
            raise ConfigError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, got "
                              f"{self.uvicorn_log_level!r}", field="uvicorn_log_level")

    @property
    def api_keys(self) -> list[str]:
        """The keys a request may send (any one of them); [] when none is required."""
        return list(self.api_key or [])

    @property
    def log_level_of_requests(self) -> str | None:
        """The `logging` level name of the server's loggers (--uvicorn-log-level); None: as --log-level set."""
        return UVICORN_LOG_LEVELS[self.uvicorn_log_level.lower()] if self.uvicorn_log_level else None


def server_config_from_dict(values: dict[str, Any]) -> ServerConfig:
    try:
        return msgspec.convert(values, ServerConfig)
    except msgspec.ValidationError as exc:
        if isinstance(exc.__cause__, ConfigError):  # raised by our own checks in __post_init__
            raise exc.__cause__ from None
        raise ConfigError(f"invalid server option: {exc}") from exc
