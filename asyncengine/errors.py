"""The errors asyncengine raises on purpose.

Every error says what was wrong and what to do. The four public ones are re-exported from
`asyncengine`; the others are subclasses, so `except StartupError` catches every way a start can fail.
"""

from __future__ import annotations


class AsyncEngineError(Exception):
    """Base class of every error asyncengine raises on purpose."""


class RequestError(AsyncEngineError, ValueError):
    """A request was invalid (the HTTP 400 family). `field` names the offending parameter; `source`, when
    set, names the plugin that refused it (e.g. a logits processor's validate_params), so the HTTP
    layer can say who did; `code`, when set, is OpenAI's error code for it (`context_length_exceeded`)."""

    def __init__(self, message: str, *, field: str | None = None, source: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.source = source
        self.code = code


class EngineOverloadedError(AsyncEngineError):
    """The waiting queue is full (HTTP 503); retry later."""


class EngineDeadError(AsyncEngineError):
    """The engine can no longer serve requests: a process died or the engine was shut down."""


class StartupError(AsyncEngineError):
    """The engine could not start. The message names the phase and the culprit."""


class ConfigError(StartupError, ValueError):
    """The configuration is unusable (CLI exit code 2). `field` names the offending option."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ModelLoadError(StartupError):
    """The model could not be found or loaded: a missing or corrupt file, an unknown architecture."""


class UnsupportedArchitectureError(ModelLoadError, ValueError):
    """No model class is registered for the model's architecture(s) (a ValueError, as vLLM's is)."""


class MissingRegistration(StartupError):
    """A child process lacks a registry key the frontend has (the manifest check)."""


class WorkerError(AsyncEngineError):
    """A worker method called by name (collective_rpc, a start-up step) raised; the message names the rank."""


# Errors that keep their type when they cross a process boundary (by name, never pickled).
_TRANSPORTABLE = {cls.__name__: cls for cls in (RequestError, ConfigError, ModelLoadError, UnsupportedArchitectureError,
                                                  StartupError,
                                                  MissingRegistration, EngineDeadError, EngineOverloadedError, WorkerError)}


def error_type_name(exc: BaseException) -> str:
    return type(exc).__name__


def error_field(exc: BaseException) -> str | None:
    return getattr(exc, "field", None)


def rebuild_error(
    type_name: str | None, message: str, field: str | None = None, *, default: type[AsyncEngineError] | None = None
) -> AsyncEngineError:
    """The error a peer reported, as our class of the same name (else `default`, else WorkerError)."""
    cls = _TRANSPORTABLE.get(type_name or "", default or WorkerError)
    if cls in (RequestError, ConfigError):
        return cls(message, field=field)
    return cls(message)
