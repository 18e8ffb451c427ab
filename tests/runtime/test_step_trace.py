"""The engine core's step trace carries the worker's own time split (wire.worker.StepTimings): input
preparation, forward pass, sampling. bench/gpu.py prints it as the decode-step split; this checks that it is
measured and that it arrives intact from a worker in its own process."""

from __future__ import annotations

import pytest

from asyncengine import SamplingParams
from asyncengine.engine_core.loop import StepRecord
from asyncengine.frontend.async_engine import AsyncEngine

pytestmark = pytest.mark.anyio


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")


@pytest.mark.parametrize("options", [dict(), dict(in_process=False, distributed_executor_backend="mp")],
                         ids=["uni", "mp worker"])
async def test_each_step_record_holds_the_workers_split(llama, options):
    async with AsyncEngine.start(model=str(llama.path), skip_tokenizer_init=True, max_model_len=128,
                                 kv_cache_memory_bytes=2**22, **options) as engine:
        await engine.call_engine_core("start_step_trace")
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        async for _ in engine.generate({"prompt_token_ids": [5, 6, 7, 8]}, params):
            pass
        trace = await engine.call_engine_core("stop_step_trace")
    assert len(trace) == 6  # one prefill step, then five decode steps
    for row in trace:
        record = StepRecord(*row)
        worker_time = record.execute_end - record.execute_start
        parts = (record.prepare, record.forward, record.sample)
        assert all(part > 0 for part in parts), record
        # The three parts are consecutive spans inside the worker's step (which also updates its state).
        assert sum(parts) <= worker_time + 1e-6, record
        assert sum(parts) >= 0.5 * worker_time, record
        assert record.device_forward == -1.0 and record.cuda_graph is False  # CPU: no events, no graphs
