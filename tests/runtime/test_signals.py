"""SIGTERM and SIGINT stop a serving process gracefully: stop admitting, finish or abort, exit 0."""

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
    from asyncengine import AsyncEngine, SamplingParams
    from asyncengine.runtime.signals import stop_on_signals

    async def consume(engine, name, max_tokens, results):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        tokens, reason = 0, None
        async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, params):
            tokens += len(out.outputs[0].token_ids)
            reason = out.outputs[0].finish_reason
            if name == "long" and tokens >= 5 and "ready" not in results:
                results["ready"] = True
                print(json.dumps({"ready": True, "core_pid": engine._core.process.pid}), flush=True)
        results[name] = [tokens, reason]

    async def main():
        results = {}
        async with AsyncEngine.start(model=sys.argv[1], skip_tokenizer_init=True, max_model_len=1024,
                                     kv_cache_memory_bytes=2**27, in_process=False) as engine:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stop_on_signals, engine, tg.cancel_scope, float(sys.argv[2]))
                async with anyio.create_task_group() as requests:
                    requests.start_soon(consume, engine, "long", 1000, results)
                    requests.start_soon(consume, engine, "short", 16, results)
                tg.cancel_scope.cancel()
        print(json.dumps(results), flush=True)

    anyio.run(main, backend="trio")
    """
)


@pytest.fixture
def model_path(default_model_dir):
    # The real model: slow enough on CPU (about 15 tokens/s per sequence) that a 1000-token request
    # cannot finish in the grace period while a 16-token one does.
    return str(default_model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_short_requests_aborts_long_ones_and_exits_0(model_path, sig):
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, model_path, "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        ready = json.loads(process.stdout.readline())
        assert ready["ready"]
        process.send_signal(sig)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    results = json.loads(out.strip().splitlines()[-1])
    assert results["short"] == [16, "length"]  # finished within the grace period
    long_tokens, long_reason = results["long"]
    assert long_reason == "abort" and 5 <= long_tokens < 1000  # did not fit: aborted
    time.sleep(0.5)
    assert not os.path.exists(f"/proc/{ready['core_pid']}"), "the engine-core process outlived the frontend"
