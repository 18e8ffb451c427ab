"""ServerConfig: the HTTP server's own options (the engine's are EngineConfig's).

`asyncengine serve` derives one flag per field, as it does for EngineConfig: `api_key` is `--api-key`.
"""

from __future__ import annotations

import os

import msgspec

from asyncengine.errors import ConfigError


class ServerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer token required on /v1/*; default: the environment variable ASYNCENGINE_API_KEY.
    api_key: str | None = None
    max_request_body_bytes: int = 2 * 2**20  # a larger body is a 413
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    tool_parser_plugin: str | None = None  # a module or .py file that registers tool parsers
    reasoning_parser_plugin: str | None = None
    middleware: list[str] = msgspec.field(default_factory=list)  # "pkg.mod:obj", applied in order
    shutdown_grace_period: float = 30.0  # seconds streams may take to finish after SIGINT/SIGTERM

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0..65535, got {self.port}", field="port")
        if self.max_request_body_bytes < 1024:
            raise ConfigError(f"max_request_body_bytes must be at least 1024, got {self.max_request_body_bytes}",
                              field="max_request_body_bytes")
        if self.shutdown_grace_period < 0:
            raise ConfigError("shutdown_grace_period must not be negative", field="shutdown_grace_period")
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
