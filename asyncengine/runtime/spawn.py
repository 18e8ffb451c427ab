"""Start a child role as a fresh interpreter (`python -m ...`) through anyio, never `multiprocessing`.

The child learns where to connect and the per-launch secret from its environment (not argv, which
other users can read in the process table); everything else arrives as msgspec frames after it
connects. `describe_exit` turns a return code into the words an EngineDeadError uses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
from anyio.abc import Process

ENV_ADDRESS = "ASYNCENGINE_IPC_ADDRESS"
ENV_SECRET = "ASYNCENGINE_IPC_SECRET"
ENV_RANK = "ASYNCENGINE_IPC_RANK"

# The directory holding the `asyncengine` package: children must import the same code as the parent,
# even when the parent found it through a sys.path entry the environment does not carry.
_SOURCE_ROOT = str(Path(__file__).resolve().parents[2])


async def spawn_child(module: str, *, address: str, secret: str, rank: int = 0) -> Process:
    env = dict(os.environ)
    env[ENV_ADDRESS] = address
    env[ENV_SECRET] = secret
    env[ENV_RANK] = str(rank)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _SOURCE_ROOT not in paths:
        env["PYTHONPATH"] = os.pathsep.join([_SOURCE_ROOT, *paths])
    return await anyio.open_process(
        [sys.executable, "-m", module], stdin=subprocess.DEVNULL, stdout=None, stderr=None, env=env
    )


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


async def stop_process(process: Process, *, grace_period: float) -> None:
    """Wait up to `grace_period` for `process` to exit on its own, then terminate it, then kill it."""
    with anyio.CancelScope(shield=True):
        with anyio.move_on_after(grace_period):
            await process.wait()
            return
        if process.returncode is None:
            process.terminate()
            with anyio.move_on_after(2.0):
                await process.wait()
                return
            process.kill()
            await process.wait()


def die_with_parent() -> None:
    """Linux: have the kernel kill this process when the parent that started it exits.

    The connection to the parent closing also stops a child; this covers a parent that dies while
    the child is busy (loading a model, say) and not reading its connection.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)
