"""The scheduler's side of KV connectors: what it asks, what it accepts, what it counts, what it sends."""

from __future__ import annotations

import msgspec
import pytest

from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.scheduler import Scheduler
from asyncengine.interfaces.kv_connector import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
)
from asyncengine.config.kv_transfer import parse_kv_transfer_config
from asyncengine.server.metrics import PrometheusStatLogger
from asyncengine.wire.engine_core import EngineCoreRequest, SamplingOptions, SchedulerStats
from asyncengine.wire.worker import ModelRunnerOutput, SchedulerOutput

BLOCK = 4


class StepMeta(KVConnectorMetadata, kw_only=True):
    steps: list[tuple[str, int, int]]  # (request id, computed before, scheduled)


class Offering(KVConnectorBase):
    """Offers `offer` tokens to every request and notes every call."""

    metadata_cls = StepMeta
    offer = 0

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.calls: list[tuple] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.request_id, num_computed_tokens, len(request.block_hashes)))
        return self.offer

    def update_state_after_alloc(self, request, num_external_tokens):
        self.calls.append(("alloc", request.request_id, num_external_tokens, len(request.block_ids)))

    def build_connector_meta(self, requests):
        return StepMeta(steps=[(r.request_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in requests])

    def request_finished(self, request):
        self.calls.append(("finished", request.request_id))


def make(offer: int, *, num_blocks: int = 32, budget: int = 64) -> tuple[Scheduler, Offering]:
    scheduler = Scheduler(block_manager=BlockManager(num_blocks, BLOCK), max_num_seqs=8,
                          max_num_batched_tokens=budget, max_model_len=128)
    context = KVConnectorContext(block_size=BLOCK, tensor_parallel_size=1, rank=0, architecture="A", dtype="float32",
                                 model="m")
    connector = Offering(parse_kv_transfer_config({"kv_connector": "Offering"}), KVConnectorRole.SCHEDULER, context)
    connector.offer = offer
    scheduler.kv_connector = connector
    return scheduler, connector


def add(scheduler: Scheduler, request_id: str, tokens: list[int], max_tokens: int = 1) -> None:
    scheduler.add_request(EngineCoreRequest(request_id=request_id, prompt_token_ids=tokens,
                                            sampling=SamplingOptions(max_tokens=max_tokens)))


def finish_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
    ids = [rid for rid in output.num_scheduled_tokens
           if scheduler.sequences[rid].num_computed_tokens >= scheduler.sequences[rid].num_tokens]
    scheduler.update_from_output(output, ModelRunnerOutput(request_ids=ids, sampled_token_ids=[7] * len(ids)))


def test_the_connector_supplies_all_but_the_last_prompt_token_and_it_is_counted():
    scheduler, connector = make(offer=10**6)  # it claims more than any prompt has
    add(scheduler, "a", list(range(10)))
    output = scheduler.schedule()
    # Cut to leave the last prompt token to compute: 9 supplied, 1 computed.
    assert output.num_scheduled_tokens == {"a": 1}
    assert output.new_requests[0].num_computed_tokens == 9
    assert connector.calls == [("match", "a", 0, 2), ("alloc", "a", 9, 3)]
    metadata = Offering.decode_metadata(output.kv_connector_metadata)  # msgpack bytes, decoded as its Struct
    assert metadata == StepMeta(steps=[("a", 9, 1)])
    # The SchedulerOutput, metadata included, crosses to a worker process as msgpack.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(output), type=SchedulerOutput) == output
    finish_step(scheduler, output)
    stats = scheduler.stats()
    assert (stats.num_prompt_tokens_computed, stats.num_kv_connector_loaded_tokens) == (1, 9)
    assert connector.calls[-1] == ("finished", "a")


def test_without_an_offer_every_prompt_token_is_computed_in_chunks():
    scheduler, connector = make(offer=0, budget=4)
    add(scheduler, "a", list(range(10)))
    computed = []
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        computed.append(output.num_scheduled_tokens["a"])
        assert Offering.decode_metadata(output.kv_connector_metadata).steps == [("a", sum(computed[:-1]), computed[-1])]
        finish_step(scheduler, output)
    assert computed == [4, 4, 2]
    assert (scheduler.stats().num_prompt_tokens_computed, scheduler.stats().num_kv_connector_loaded_tokens) == (10, 0)


def test_the_connector_is_asked_after_the_local_prefix_cache():
    scheduler, connector = make(offer=0)
    add(scheduler, "a", list(range(10)))
    finish_step(scheduler, scheduler.schedule())
    connector.offer = 1  # one more token than the local cache's two full blocks
    add(scheduler, "b", list(range(10)))
    output = scheduler.schedule()
    assert ("match", "b", 8, 2) in connector.calls and ("alloc", "b", 1, 3) in connector.calls
    assert output.num_scheduled_tokens == {"b": 1}
    assert scheduler.stats().num_prompt_tokens_computed == 11 and scheduler.stats().num_kv_connector_loaded_tokens == 1


@pytest.mark.parametrize("answer", [-1, 2.0, None])
def test_a_connector_answer_that_is_no_count_is_an_error_naming_it(answer):
    scheduler, connector = make(offer=answer)
    add(scheduler, "a", list(range(10)))
    with pytest.raises(ValueError, match=r"KV connector Offering.get_num_new_matched_tokens returned .* for "
                                         r"request 'a': it must return a count of tokens"):
        scheduler.schedule()


def test_the_metrics_follow_the_scheduler_totals_once_each():
    logger = PrometheusStatLogger(model_name="m")
    for computed, loaded in ((6, 64), (6, 64), (12, 64)):  # a step's stats, then a scrape's: counted once
        logger.update_scheduler_stats(SchedulerStats(num_prompt_tokens_computed=computed,
                                                     num_kv_connector_loaded_tokens=loaded))
    text = logger.render()[0].decode()
    assert 'asyncengine:prompt_tokens_computed_total{model_name="m"} 12.0' in text
    assert 'asyncengine:kv_connector_loaded_tokens_total{model_name="m"} 64.0' in text
