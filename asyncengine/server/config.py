"""ServerConfig: the HTTP server's own options (the engine's are EngineConfig's).

`asyncengine serve` derives one flag per field, as it does for EngineConfig: `api_key` is `--api-key`.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import msgspec

from asyncengine.errors import ConfigError


class ServerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer token required on every route but /health, /metrics and /version (server/access.py);
    # default: the environment variable ASYNCENGINE_API_KEY.
    api_key: str | None = None
    max_request_body_bytes: int = 2 * 2**20  # a larger body is a 413
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    tool_parser_plugin: str | None = None  # a module or .py file that registers tool parsers
    reasoning_parser_plugin: str | None = None
    middleware: list[str] = msgspec.field(default_factory=list)  # "pkg.mod:obj", applied in order
    shutdown_grace_period: float = 30.0  # seconds streams may take to finish after SIGINT/SIGTERM
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open
    # Seconds from a request's headers to the end of its body; later, a 408 and the connection closed
    # (server/body_deadline.py). 30 s: a 2 MiB body (the default limit) at 70 KB/s.
    request_body_timeout: float = 30.0
    # After the engine dies the server exits with status 1 (a supervisor restarts it); this keeps it
    # up instead, answering 503.
    keep_serving_after_engine_death: bool = False
    # Origins (scheme://host[:port]) browsers may call the API from, or "*"; none: no CORS headers.
    allowed_origins: list[str] = msgspec.field(default_factory=list)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (server/serving_lora.py); also enabled by the
    # environment variable ASYNCENGINE_ALLOW_RUNTIME_LORA_UPDATING=1, as vLLM's.
    enable_runtime_lora_updates: bool = False

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
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser NAME", field="tool_call_parser")
        if self.api_key is None:
            self.api_key = os.environ.get("ASYNCENGINE_API_KEY") or None


def server_config_from_dict(values: dict) -> ServerConfig:
    try:
        return msgspec.convert(values, ServerConfig)
    except msgspec.ValidationError as exc:
        if isinstance(exc.__cause__, ConfigError):  # raised by our own checks in __post_init__
            raise exc.__cause__ from None
        raise ConfigError(f"invalid server option: {exc}") from exc
