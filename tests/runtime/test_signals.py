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

    async def consume(engine, name, max_tokens, results, progress):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        tokens, reason = 0, None
        async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, params):
            tokens += len(out.outputs[0].token_ids)
            progress[name] = tokens
            reason = out.outputs[0].finish_reason
            if progress.get("short", 0) >= READY_AT and "long" in progress and "ready" not in results:
                results["ready"] = True
                print(json.dumps({"ready": True, "core_pid": engine._core.process.pid,
                                  "short_tokens": progress["short"]}), flush=True)
        results[name] = [tokens, reason]

    READY_AT = int(sys.argv[3])

    async def main():
        results, progress = {}, {}
        async with AsyncEngine.start(model=sys.argv[1], skip_tokenizer_init=True, max_model_len=1024,
                                     kv_cache_memory_bytes=2**27, in_process=False) as engine:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stop_on_signals, engine, tg.cancel_scope, float(sys.argv[2]))
                async with anyio.create_task_group() as requests:
                    requests.start_soon(consume, engine, "long", 1000, results, progress)
                    requests.start_soon(consume, engine, "short", 16, results, progress)
                tg.cancel_scope.cancel()
        print(json.dumps(results), flush=True)

    anyio.run(main, backend="trio")
    """
)


# The signal comes once the 16-token request has READY_AT tokens: it has 4 left to finish within GRACE
# seconds (0.8 token/s is enough, on a loaded machine too), while the 1000-token one cannot. The test
# lasts the whole grace period (the long request is aborted at its end), so it is no longer than needed.
READY_AT = 12
GRACE = 5


@pytest.fixture
def model_path(default_model_dir):
    # The real model: slow enough on CPU (about 15 tokens/s per sequence) that a 1000-token request
    # cannot finish in the grace period while a 16-token one does.
    return str(default_model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_short_requests_aborts_long_ones_and_exits_0(model_path, sig):
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, model_path, str(GRACE), str(READY_AT)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True
    )
    try:
        ready = json.loads(process.stdout.readline())
        assert ready["ready"]
        assert ready["short_tokens"] < 16, ready  # the short request still runs when the signal comes
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
