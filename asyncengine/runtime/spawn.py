"""Start a child role as a fresh interpreter (`python -m ...`) through anyio, never `multiprocessing`.

The child learns where to connect and the per-launch secret from its environment (not argv, which
other users can read in the process table); everything else arrives as msgspec frames after it
connects. `describe_exit` turns a return code into the words an EngineDeadError uses.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
from anyio.abc import Process

ENV_ADDRESS = "ASYNCENGINE_IPC_ADDRESS"
ENV_SECRET = "ASYNCENGINE_IPC_SECRET"
ENV_RANK = "ASYNCENGINE_IPC_RANK"
LOG_LEVEL_ENV = "ASYNCENGINE_LOG_LEVEL"  # a child's log level (runtime/child.py reads it)

# The directory holding the `asyncengine` package: children must import the same code as the parent,
# even when the parent found it through a sys.path entry the environment does not carry.
_SOURCE_ROOT = str(Path(__file__).resolve().parents[2])


async def spawn_child(module: str, *, address: str, secret: str, rank: int = 0) -> Process:
    env = dict(os.environ)
    env[ENV_ADDRESS] = address
    env[ENV_SECRET] = secret
    env[ENV_RANK] = str(rank)
    # The child logs at this process's level unless told otherwise: `serve` logs at INFO, so its engine
    # core's progress lines (the C kernels' build, ...) show with the frontend's.
    env.setdefault(LOG_LEVEL_ENV, logging.getLevelName(logging.getLogger().getEffectiveLevel()))
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


def die_with_parent(poll_interval: float = 0.5) -> None:
    """Exit as soon as the process that started this one is gone.

    The connection to the parent closing also stops a child, but only when the child reads it; this
    covers a parent killed while the child is busy (loading a model, say). A watcher thread blocks on
    a pidfd of the parent, which becomes readable the moment the parent exits (Linux 5.3+); where
    there is none, it polls the parent pid every `poll_interval` seconds (when the parent dies the
    child is re-parented and the pid changes). (Linux's PR_SET_PDEATHSIG is no substitute: it fires
    when the parent *thread* that spawned the child ends, and event loops spawn from short-lived
    helper threads.)
    """
    parent = os.getppid()
    try:
        parent_fd: int | None = os.pidfd_open(parent)
    except (AttributeError, OSError):  # not Linux, an old kernel, or the parent already gone (checked below)
        parent_fd = None

    def watch() -> None:
        if parent_fd is not None and os.getppid() == parent:  # the fd is the parent's, not a reused pid's
            select.select([parent_fd], [], [])
        else:
            while os.getppid() == parent:
                time.sleep(poll_interval)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
