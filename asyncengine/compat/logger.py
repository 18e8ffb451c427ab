"""vLLM's `vllm.logger.init_logger`: a module's logger, with vLLM's `info_once`, `warning_once` and
`debug_once` (each message logged once per process), which plugins call."""

from __future__ import annotations

import logging
from typing import Any

_logged_once: set[tuple[str, int, str]] = set()


class VllmLogger(logging.LoggerAdapter[logging.Logger]):
    """`logging.getLogger(name)` with vLLM's once-only methods; everything else is the logger's."""

    def _once(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        key = (self.logger.name, level, msg % args if args else msg)
        if key not in _logged_once:
            _logged_once.add(key)
            kwargs.setdefault("stacklevel", 3)
            self.log(level, msg, *args, **kwargs)

    def debug_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.DEBUG, msg, *args, **kwargs)

    def info_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.INFO, msg, *args, **kwargs)

    def warning_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.WARNING, msg, *args, **kwargs)

    @property
    def handlers(self) -> list[logging.Handler]:
        return self.logger.handlers

    def addHandler(self, handler: logging.Handler) -> None:  # noqa: N802 (logging's name)
        self.logger.addHandler(handler)


def init_logger(name: str) -> VllmLogger:
    """The logger of module `name` (plugins pass `__name__`), as vLLM's `init_logger` returns it."""
    return VllmLogger(logging.getLogger(name), {})


__all__ = ["VllmLogger", "init_logger"]
