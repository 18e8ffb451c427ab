"""The errors asyncengine raises on purpose.

Every error says what was wrong and what to do. The four public ones are re-exported from
`asyncengine`; the others are subclasses, so `except StartupError` catches every way a start can fail.
"""

from __future__ import annotations

import os
import sysconfig
import traceback


class AsyncEngineError(Exception):
    """Base class of every error asyncengine raises on purpose."""

    # The offending parameter or option, for the errors that name one (RequestError, ConfigError).
    field: str | None = None
    # True once the message names the process (and start-up phase) it failed in: an enclosing start-up
    # phase passes the error on unchanged (plugin_runtime/records.py).
    names_its_process: bool = False


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
    """The engine can no longer serve requests: a process died or the engine was shut down.

    When an exception killed it (a plugin's scheduler raising in `schedule()`, a worker's step), the
    error carries what it was, across processes too: `cause_type` (its qualified class name,
    `builtins.RuntimeError`), `cause_message` (its str()) and `culprit` (the code that raised it, the
    process and the phase). str() contains the original `Type: message`. In the process that raised
    it the original exception is also the `__cause__`.
    """

    def __init__(self, message: str, *, cause_type: str | None = None, cause_message: str | None = None,
                 culprit: str | None = None) -> None:
        super().__init__(message)
        self.cause_type = cause_type
        self.cause_message = cause_message
        self.culprit = culprit

    @classmethod
    def from_exception(cls, where: str, exc: BaseException, *, process: str, phase: str) -> EngineDeadError:
        """`where` failed with `exc`, in `process` during `phase`: the error naming all of them."""
        code = raising_code(exc)
        culprit = f"{code + ' in ' if code else ''}{process}, {phase}"
        summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        error = cls(f"{where} failed: {summary} (raised by {culprit})", cause_type=qualified_type_name(exc),
                    cause_message=str(exc), culprit=culprit)
        error.__cause__ = exc
        return error

    def again(self) -> EngineDeadError:
        """A fresh error equal to this one, for each later caller (a raised error collects a traceback)."""
        error = EngineDeadError(str(self), cause_type=self.cause_type, cause_message=self.cause_message,
                                culprit=self.culprit)
        error.__cause__ = self.__cause__
        return error


def qualified_type_name(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def raising_code(exc: BaseException) -> str | None:
    """The code outside asyncengine that `exc` came from: the outermost function in its traceback
    that is neither asyncengine's nor a library's it runs on (the standard library, torch, anyio,
    trio, msgspec), as `module.Class.method` -- the plugin hook asyncengine called. None when
    asyncengine's own code raised it."""
    frame_traceback = exc.__traceback__
    while frame_traceback is not None:
        frame = frame_traceback.tb_frame
        module = frame.f_globals.get("__name__", "")
        filename = frame.f_code.co_filename
        if (module.partition(".")[0] not in _NOT_PLUGIN_CODE and not filename.startswith(_OUR_FOLDER)
                and not _in_the_standard_library(filename)):
            return f"{module}.{frame.f_code.co_qualname}"
        frame_traceback = frame_traceback.tb_next
    return None


_NOT_PLUGIN_CODE = {"asyncengine", "torch", "anyio", "trio", "msgspec", "outcome", "sniffio", "builtins"}
_PATHS = sysconfig.get_paths()
# By file as well as by module name: a role's process runs its module as __main__.
_OUR_FOLDER = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _in_the_standard_library(filename: str) -> bool:
    # site-packages may lie inside the standard library's folder (an interpreter without a venv)
    return filename.startswith(_PATHS["stdlib"]) and not filename.startswith((_PATHS["purelib"], _PATHS["platlib"]))


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
