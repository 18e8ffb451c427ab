"""No child outlives its parent: SIGKILL the frontend, and the engine core and its workers go too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import anyio
    from asyncengine import AsyncEngine

    async def main():
        async with AsyncEngine.start(model=sys.argv[1], skip_tokenizer_init=True, max_model_len=128,
                                     kv_cache_memory_bytes=2**22, in_process=False,
                                     distributed_executor_backend="mp") as engine:
            workers = await engine.collective_rpc("describe")
            print(json.dumps({"core": engine._core.process.pid, "workers": [w["pid"] for w in workers]}), flush=True)
            await anyio.sleep(600)

    anyio.run(main, backend="trio")
    """
)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.fixture
def model_path(tiny_model):
    return str(tiny_model("llama").path)


def test_killing_the_frontend_takes_the_engine_processes_with_it(model_path):
    frontend = subprocess.Popen([sys.executable, "-c", SCRIPT, model_path], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(frontend.stdout.readline())
        children = [pids["core"], *pids["workers"]]
        assert all(alive(pid) for pid in children)
        os.kill(frontend.pid, signal.SIGKILL)
        frontend.wait()
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if alive(pid)], "engine processes outlived the frontend"
    finally:
        if frontend.poll() is None:
            frontend.kill()
