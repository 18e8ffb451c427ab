"""Unwrap the exception groups that task groups raise when only one thing went wrong.

trio (and anyio on it) wraps even a single exception from a task group's body in an
ExceptionGroup. A caller of `AsyncEngine.start` who raises inside the `async with`, or an engine that
fails to start, should see that one exception, not a group around it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


def leaves_of(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions in `group` and in the groups inside it, in order."""
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves.extend(leaves_of(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return leaves


@contextmanager
def single_exceptions() -> Iterator[None]:
    """Re-raise a group that holds exactly one exception as that exception."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = leaves_of(group)
        if len(leaves) == 1:
            raise leaves[0] from group.__cause__
        raise
