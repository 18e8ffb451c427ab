"""The AsyncEngine's one request table (issue 31), in-process: a pooling request is a request like a generation,
with the same admission places, the same step handler (its one output, or its error, to its consumer), the same
abort path and the same death; the stat loggers do not track it (it generates no tokens). The end-to-end paths
(encode, pool under max_waiting_requests, cancelling) are tests/pooling/test_pooling_engine.py."""

from __future__ import annotations

import anyio
import pytest
import torch  # noqa: F401  (tensor_of imports it on first use: not inside the timed event loop)

from asyncengine.config.engine import EngineConfig
from asyncengine.errors import EngineDeadError, RequestError
from asyncengine.frontend.iteration_stats import StatsTracker
from asyncengine.frontend.pooling import PoolingProcessor, PoolingPrompt
from asyncengine.frontend.request_state import RequestTable
from asyncengine.pooling.outputs import PoolingRequestOutput
from asyncengine.wire.engine_core import EngineCoreOutput, EngineCoreOutputs, FinishReason
from asyncengine.wire.pooling import PooledTensor, PoolingOptions

VECTOR = PooledTensor(data=b"\0\0\x80?" * 4, shape=[4])  # four float32 ones


def _table() -> tuple[RequestTable, StatsTracker, PoolingProcessor]:
    stats = StatsTracker()
    return RequestTable(2, stats, lambda: True), stats, PoolingProcessor(EngineConfig(), None, None)


def _prompt() -> PoolingPrompt:
    return PoolingPrompt(request_id="", prompt=None, prompt_token_ids=[5, 6, 7], options=PoolingOptions(task="embed"))


async def _in_core(table: RequestTable, pooling: PoolingProcessor, request_id: str | None):
    """A pooling request opened, admitted and sent: its record and its one engine-core request."""
    record = table.open(*pooling.new_request(_prompt(), request_id))
    assert await table.admit(record, nowait=True)
    (request,) = table.send(record)
    return record, request


def _step(core_id: str, **fields) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=core_id, new_token_ids=[], **fields)],
                             admitted_request_ids=[core_id])


@pytest.mark.anyio
async def test_a_pooling_request_gets_its_output_and_gives_its_place_back():
    table, stats, pooling = _table()
    record, request = await _in_core(table, pooling, None)
    assert record.request_id == "pool-0" and "pool-0" in table and table.gate.count == 1
    assert request.pooling is not None and len(stats) == 0  # not tracked by the stat loggers
    assert table.on_step(_step(request.request_id, finish_reason=FinishReason.STOP, pooled=VECTOR)) == []
    output = await record.next_output()
    assert isinstance(output, PoolingRequestOutput) and output.finished and output.request_id == "pool-0"
    assert output.outputs.data.tolist() == [1.0] * 4 and output.prompt_token_ids == [5, 6, 7]
    assert len(table) == 0 and table.gate.count == 0


@pytest.mark.anyio
async def test_a_pooling_request_a_worker_refused_fails_alone_naming_the_field():
    table, _, pooling = _table()
    record, request = await _in_core(table, pooling, "mine")
    table.on_step(_step(request.request_id, finish_reason=FinishReason.ERROR, error="no pooler", error_field="model"))
    with pytest.raises(RequestError, match="no pooler") as info:
        await record.next_output()
    assert info.value.field == "model" and len(table) == 0 and table.gate.count == 0


@pytest.mark.anyio
async def test_abort_and_death_take_the_same_path_for_every_kind():
    table, _, pooling = _table()
    waiting, request = await _in_core(table, pooling, "a")
    # abort(request_id): the engine-core id to abort there, and the consumer learns it was aborted.
    assert table.abort_by_id("a", notify=True) == [request.request_id]
    with pytest.raises(RequestError, match="'a' was aborted"):
        await waiting.next_output()
    with pytest.raises(RequestError, match="already in use"):  # an id is taken while its request is open
        table.open(*pooling.new_request(_prompt(), "b"))
        table.open(*pooling.new_request(_prompt(), "b"))
    in_core, sent = await _in_core(table, pooling, "c")
    assert set(table.fail_all(EngineDeadError("gone"))) == {sent.request_id}
    with pytest.raises(EngineDeadError, match="gone"), anyio.fail_after(5):
        await in_core.next_output()
    assert len(table) == 0
