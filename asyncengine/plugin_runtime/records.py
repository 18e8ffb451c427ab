"""The start-up report: one record per phase and per plugin, in every process.

Children send their records back with their Ready (or StartupFailed), so the frontend holds the
whole start: printed by `asyncengine plugins timeline --trace FILE`, written to `startup_trace`,
served at `GET /v1/startup`.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec

from asyncengine.errors import AsyncEngineError, StartupError
from asyncengine.interfaces.plugin_code import set_role_source
# The Struct travels in the hand-shake, so it lives on the wire; re-exported for the code that traces.
from asyncengine.wire.startup import StartupRecord as StartupRecord

OK, SKIPPED, FAILED = "ok", "skipped", "failed"  # StartupRecord.outcome


class PhaseFailure(StartupError):
    """A start-up phase failed; the message names the process, the phase and the culprit."""

    names_its_process = True  # see `phase`: an enclosing phase passes it on as it is

    def __init__(self, message: str, *, phase: str, original: BaseException | None = None) -> None:
        super().__init__(message)
        self.phase = phase
        self.original = original


_process_role: str | None = None
set_role_source(lambda: _process_role)  # plugin code that raises is named with this process's role


def current_process_role() -> str:
    """The role this process started as: "frontend", "engine core", "worker rank N" (a plugin may
    record where its code runs). In-process, the frontend's process plays every role: "frontend"."""
    if _process_role is None:
        raise StartupError("no engine has started in this process yet, so it has no role")
    return _process_role


class StartupTrace:
    """The records of one process."""

    def __init__(self, role: str) -> None:
        global _process_role
        if _process_role is None:
            _process_role = role
        self.role = role
        self.pid = os.getpid()
        self.records: list[StartupRecord] = []
        self.ready = False  # set once the process reported Ready: later failures are not start-up failures

    @property
    def process(self) -> str:
        return f"the {self.role} (pid {self.pid})"

    def add(self, phase: str, *, started: float, outcome: str = OK, **fields) -> StartupRecord:
        record = StartupRecord(
            pid=self.pid, role=self.role, phase=phase, outcome=outcome, start=started,
            duration=time.time() - started, **fields,
        )
        self.records.append(record)
        return record

    def extend(self, records: list[StartupRecord]) -> None:
        self.records.extend(records)

    def named_failure(self, phase: str, exc: BaseException) -> Exception:
        """`exc` as an error naming this process and `phase` (see name_the_phase)."""
        return name_the_phase(self.process, phase, exc)

    @asynccontextmanager
    async def phase(self, name: str) -> AsyncIterator[None]:
        """Record the phase; a failure inside becomes PhaseFailure naming the process and the phase
        (our own error types keep their type, with the same naming). An error that already names
        where it happened (an inner phase's, or one a child process reported) passes on unchanged, so
        the message names the process and phase where the failure began, once."""
        started = time.time()
        try:
            yield
        except Exception as exc:  # recorded, then re-raised with the process and phase named
            if getattr(exc, "names_its_process", False):
                self.add(name, started=started, outcome=FAILED, reason=str(exc))
                raise
            self.add(name, started=started, outcome=FAILED, reason=format_failure(exc))
            raise name_the_phase(self.process, name, exc) from exc
        else:
            self.add(name, started=started)


def name_the_phase(process: str, phase: str, exc: BaseException) -> Exception:
    detail = str(exc) if isinstance(exc, AsyncEngineError) else f"{type(exc).__name__}: {exc}"
    message = f"{process} failed in start-up phase {phase!r}: {detail}"
    if isinstance(exc, AsyncEngineError) and not isinstance(exc, PhaseFailure):
        named = type(exc)(message)  # keep ConfigError (exit 2), ModelLoadError, ...
        if getattr(exc, "field", None) is not None:
            named.field = exc.field
        named.names_its_process = True
        return named
    return PhaseFailure(message, phase=phase, original=exc)


def reported_by_child(error: AsyncEngineError) -> AsyncEngineError:
    """Mark an error a child process reported at start-up: its message already names the child and
    its phase, so the parent's phases pass it on unchanged."""
    error.names_its_process = True
    return error


def format_failure(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).strip()


def write_trace(path: str | os.PathLike[str], records: list[StartupRecord]) -> None:
    Path(path).write_bytes(msgspec.json.encode(records))


def read_trace(path: str | os.PathLike[str]) -> list[StartupRecord]:
    return msgspec.json.decode(Path(path).read_bytes(), type=list[StartupRecord])


def format_report(records: list[StartupRecord]) -> str:
    """Per process (in order of first appearance), its records in order, one line each."""
    lines: list[str] = []
    processes: dict[tuple[int, str, str | None], list[StartupRecord]] = {}
    for record in records:
        processes.setdefault((record.pid, record.role, record.node), []).append(record)
    for (pid, role, node), items in processes.items():
        lines.append(f"{role} (pid {pid} on {node})" if node else f"{role} (pid {pid})")
        for record in items:
            what = f"{record.phase}"
            if record.plugin:
                origin = f" [{record.distribution} {record.version}]" if record.distribution else ""
                group = f" {record.group}" if record.group else ""
                what += f":{group} {record.plugin}{origin}"
            reason = ""
            if record.reason:
                first_line = record.reason.strip().splitlines()[-1 if record.outcome == FAILED else 0]
                reason = f" ({first_line})"
            lines.append(f"  {record.duration * 1000:8.1f} ms  {record.outcome:<7} {what}{reason}")
    return "\n".join(lines)


def records_as_json(records: list[StartupRecord]) -> str:
    return json.dumps(msgspec.to_builtins(records), indent=2)
