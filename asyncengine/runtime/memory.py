"""This process's resident memory, and handing freed heap memory back to the system.

glibc's malloc keeps freed memory in its arenas for reuse: after a large structure of many small blocks is
freed (a compiled grammar: tens of MB of small vectors), the process's RSS stays where it was until
`malloc_trim` returns the free pages. Where there is no glibc (musl, macOS) trimming does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

_libc: Any = None


def rss_bytes() -> int:
    """Resident memory of this process (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def trim_heap() -> None:
    """Return the free pages of malloc's arenas to the system (glibc's malloc_trim; a no-op elsewhere).
    Takes about a millisecond per hundred MB of heap: call it off the event loop."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name) if name else False
    if _libc and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)
