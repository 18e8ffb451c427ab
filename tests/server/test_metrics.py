"""PrometheusStatLogger: the exposed metric names and labels, counters after recorded stats, gauges from
fresh scheduler stats, independent registries, and the numbers an engine run puts in them."""

from __future__ import annotations

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncengine import AsyncEngine, SamplingParams
from asyncengine.config.engine import EngineConfig
from asyncengine.frontend.iteration_stats import FinishedRequestStats, IterationStats
from asyncengine.server.metrics import PrometheusStatLogger
from asyncengine.wire.engine_core import SchedulerStats

GAUGES = ["asyncengine:num_requests_running", "asyncengine:num_requests_waiting", "asyncengine:kv_cache_usage_perc"]
COUNTERS = ["asyncengine:prompt_tokens_total", "asyncengine:generation_tokens_total",
            "asyncengine:request_success_total"]
HISTOGRAMS = ["asyncengine:time_to_first_token_seconds", "asyncengine:inter_token_latency_seconds",
              "asyncengine:e2e_request_latency_seconds"]


def samples(stat_logger: PrometheusStatLogger) -> dict[tuple[str, frozenset], float]:
    """Every exposed sample, by name and labels, parsed back from the rendered text."""
    body, _ = stat_logger.render()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def value(stat_logger: PrometheusStatLogger, name: str, **labels: str) -> float:
    return samples(stat_logger)[(name, frozenset({"model_name": stat_logger.model_name, **labels}.items()))]


def finished(reason: str, e2e: float = 1.0) -> FinishedRequestStats:
    return FinishedRequestStats(finish_reason=reason, e2e_latency=e2e, num_prompt_tokens=4, num_generation_tokens=3,
                                time_to_first_token=0.1)


def test_every_metric_is_exposed_under_its_exact_name_with_the_model_name_label():
    stat_logger = PrometheusStatLogger(model_name="tiny")
    body, content_type = stat_logger.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    text = body.decode()
    for name in GAUGES + COUNTERS:
        assert f'{name}{{model_name="tiny"' in text or f'{name}{{finished_reason=' in text, name
        assert f"# TYPE {name} " in text, name
    for name in HISTOGRAMS:
        assert f'{name}_bucket{{le="0.1",model_name="tiny"}}' in text, name
    assert "_total_total" not in text
    for reason in ("stop", "length", "abort"):  # present from the start, at zero
        assert value(stat_logger, "asyncengine:request_success_total", finished_reason=reason) == 0.0
    # Every sample carries the label.
    assert all(dict(labels)["model_name"] == "tiny" for _, labels in samples(stat_logger))


def test_the_model_name_defaults_to_the_served_model_name():
    assert PrometheusStatLogger(EngineConfig(served_model_name="served")).model_name == "served"
    assert PrometheusStatLogger(EngineConfig(model="/models/m")).model_name == "/models/m"
    assert PrometheusStatLogger().model_name == "SmolLM2-135M-Instruct"
    with pytest.raises(ValueError, match="model_name must be a non-empty string"):
        PrometheusStatLogger(model_name="")


def test_recorded_stats_increase_counters_and_histograms():
    stat_logger = PrometheusStatLogger(model_name="m")
    stat_logger.record(None, IterationStats(num_prompt_tokens=4, num_generation_tokens=2, time_to_first_tokens=[0.1]))
    stat_logger.record(None, IterationStats(num_generation_tokens=3, inter_token_latencies=[0.02, 0.03],
                                            finished_requests=[finished("length", 2.0), finished("stop")]))
    stat_logger.record(None, IterationStats(finished_requests=[finished("abort"), finished("stop")]))
    assert value(stat_logger, "asyncengine:prompt_tokens_total") == 4
    assert value(stat_logger, "asyncengine:generation_tokens_total") == 5
    assert value(stat_logger, "asyncengine:request_success_total", finished_reason="stop") == 2
    assert value(stat_logger, "asyncengine:request_success_total", finished_reason="length") == 1
    assert value(stat_logger, "asyncengine:request_success_total", finished_reason="abort") == 1
    assert value(stat_logger, "asyncengine:time_to_first_token_seconds_count") == 1
    assert value(stat_logger, "asyncengine:inter_token_latency_seconds_count") == 2
    assert value(stat_logger, "asyncengine:inter_token_latency_seconds_sum") == pytest.approx(0.05)
    assert value(stat_logger, "asyncengine:e2e_request_latency_seconds_count") == 4
    assert value(stat_logger, "asyncengine:e2e_request_latency_seconds_sum") == pytest.approx(5.0)


def test_gauges_follow_the_latest_scheduler_stats():
    stat_logger = PrometheusStatLogger(model_name="m")
    stat_logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25), IterationStats())
    assert value(stat_logger, "asyncengine:num_requests_running") == 3
    assert value(stat_logger, "asyncengine:num_requests_waiting") == 2
    assert value(stat_logger, "asyncengine:kv_cache_usage_perc") == 0.25
    stat_logger.update_scheduler_stats(SchedulerStats())  # an idle engine, just before a scrape
    assert value(stat_logger, "asyncengine:num_requests_running") == 0
    assert value(stat_logger, "asyncengine:num_requests_waiting") == 0
    assert value(stat_logger, "asyncengine:kv_cache_usage_perc") == 0.0


def test_a_dead_engine_core_is_down_with_its_gauges_zeroed_and_later_stats_ignored():
    stat_logger = PrometheusStatLogger(EngineConfig(served_model_name="m", data_parallel_size=2))
    assert value(stat_logger, "asyncengine:engine_up", engine="0") == 1
    assert value(stat_logger, "asyncengine:engine_up", engine="1") == 1
    busy = SchedulerStats(num_running_reqs=5, num_waiting_reqs=1, kv_cache_usage=0.5, num_prompt_tokens_computed=9,
                          engine_index=1)
    stat_logger.record(busy, IterationStats())
    stat_logger.mark_engine_dead(1)
    stat_logger.record(busy, IterationStats())  # its last step's stats, arriving late
    assert value(stat_logger, "asyncengine:engine_up", engine="1") == 0
    assert value(stat_logger, "asyncengine:engine_up", engine="0") == 1
    for gauge in GAUGES:
        assert value(stat_logger, gauge, engine="1") == 0, gauge
    assert value(stat_logger, "asyncengine:prompt_tokens_computed_total", engine="1") == 9  # a counter keeps its total


def test_with_one_engine_core_engine_up_has_engine_0():
    stat_logger = PrometheusStatLogger(model_name="m")
    assert value(stat_logger, "asyncengine:engine_up", engine="0") == 1
    stat_logger.record(SchedulerStats(num_running_reqs=3), IterationStats())
    stat_logger.mark_engine_dead(0)
    assert value(stat_logger, "asyncengine:engine_up", engine="0") == 0
    assert value(stat_logger, "asyncengine:num_requests_running") == 0


def test_two_loggers_do_not_clash():
    first, second = PrometheusStatLogger(model_name="a"), PrometheusStatLogger(model_name="a")
    first.record(None, IterationStats(num_generation_tokens=7))
    assert value(first, "asyncengine:generation_tokens_total") == 7
    assert value(second, "asyncengine:generation_tokens_total") == 0
    assert first.registry is not second.registry


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")  # built here, in a sync fixture: building blocks the event loop


@pytest.mark.anyio
async def test_an_engine_run_shows_up_in_the_metrics(llama):
    options = dict(skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=8 * 2**20)
    async with AsyncEngine.start(model=str(llama.path), **options) as engine:
        stat_logger = PrometheusStatLogger(engine.config, model_name=engine.model_config.served_model_name)
        engine.add_stat_logger(stat_logger)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        with anyio.fail_after(60):
            outputs = [o async for o in engine.generate({"prompt_token_ids": [5, 6, 7, 8]}, params)]
            stat_logger.update_scheduler_stats(await engine.get_scheduler_stats())
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == 6
    # Recorded (synchronously) before the final output reached us.
    assert value(stat_logger, "asyncengine:generation_tokens_total") == 6
    assert value(stat_logger, "asyncengine:prompt_tokens_total") == 4
    assert value(stat_logger, "asyncengine:request_success_total", finished_reason="length") == 1
    assert value(stat_logger, "asyncengine:time_to_first_token_seconds_count") == 1
    assert value(stat_logger, "asyncengine:inter_token_latency_seconds_count") == 5
    assert value(stat_logger, "asyncengine:e2e_request_latency_seconds_count") == 1
    assert value(stat_logger, "asyncengine:num_requests_running") == 0
