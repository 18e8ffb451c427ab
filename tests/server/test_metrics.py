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

GAUGES = ["asyncengine:num_requests_running", "asyncengine:num_requests_waiting", "asyncengine:kv_cache_usage_perc",
          "asyncengine:encoder_cache_entries", "asyncengine:encoder_cache_rows"]
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


def value(stat_logger: PrometheusStatLogger, name: str, _samples: dict | None = None, **labels: str) -> float:
    """One sample's value; `_samples`: what `samples` returned, to parse the text once for many lookups."""
    table = samples(stat_logger) if _samples is None else _samples
    return table[(name, frozenset({"model_name": stat_logger.model_name, **labels}.items()))]


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
    stat_logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25,
                                      encoder_cache_entries=2, encoder_cache_rows=48), IterationStats())
    assert value(stat_logger, "asyncengine:num_requests_running") == 3
    assert value(stat_logger, "asyncengine:num_requests_waiting") == 2
    assert value(stat_logger, "asyncengine:kv_cache_usage_perc") == 0.25
    assert value(stat_logger, "asyncengine:encoder_cache_entries") == 2
    assert value(stat_logger, "asyncengine:encoder_cache_rows") == 48
    stat_logger.update_scheduler_stats(SchedulerStats())  # an idle engine, just before a scrape
    assert value(stat_logger, "asyncengine:num_requests_running") == 0
    assert value(stat_logger, "asyncengine:num_requests_waiting") == 0
    assert value(stat_logger, "asyncengine:kv_cache_usage_perc") == 0.0
    assert value(stat_logger, "asyncengine:encoder_cache_entries") == 0


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
    # Recorded (synchronously) before the final output reached us. Parsed once: the text is long, and
    # parsing it again for each line would block this test's event loop.
    got = samples(stat_logger)
    assert value(stat_logger, "asyncengine:generation_tokens_total", got) == 6
    assert value(stat_logger, "asyncengine:prompt_tokens_total", got) == 4
    assert value(stat_logger, "asyncengine:request_success_total", got, finished_reason="length") == 1
    assert value(stat_logger, "asyncengine:time_to_first_token_seconds_count", got) == 1
    assert value(stat_logger, "asyncengine:inter_token_latency_seconds_count", got) == 5
    assert value(stat_logger, "asyncengine:e2e_request_latency_seconds_count", got) == 1
    assert value(stat_logger, "asyncengine:num_requests_running", got) == 0
    # vLLM's names carry the same figures, with vLLM's engine label.
    assert value(stat_logger, "vllm:generation_tokens_total", got, engine="0") == 6
    assert value(stat_logger, "vllm:request_success_total", got, engine="0", finished_reason="length") == 1
    assert value(stat_logger, "vllm:request_generation_tokens_sum", got, engine="0") == 6
    assert value(stat_logger, "vllm:request_params_n_count", got, engine="0") == 1
    assert value(stat_logger, "vllm:request_params_max_tokens_sum", got, engine="0") == 6
    assert value(stat_logger, "vllm:iteration_tokens_total_sum", got, engine="0") == 4 + 6
    e2e = value(stat_logger, "vllm:e2e_request_latency_seconds_sum", got, engine="0")
    phases = [value(stat_logger, f"vllm:request_{phase}_time_seconds_sum", got, engine="0")
              for phase in ("queue", "prefill", "decode")]
    assert all(p >= 0 for p in phases) and sum(phases) == pytest.approx(e2e)
    ((info_labels, info),) = [(dict(k), v) for (n, k), v in got.items() if n == "vllm:cache_config_info"]
    assert info == 1 and int(info_labels["num_gpu_blocks"]) > 0 and info_labels["engine"] == "0"
    assert (info_labels["block_size"], info_labels["kv_cache_memory_bytes"]) == ("16", str(8 * 2**20))


@pytest.fixture
def qwen3_moe(tiny_model):
    return tiny_model("qwen3_moe")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"], indirect=True)  # an engine start: one event loop is enough
async def test_a_moe_engine_run_counts_its_tokens_per_expert(qwen3_moe):
    """The workers' counts reach /metrics with each step (not only at a scrape): 4 prompt tokens and 5 fed back
    (the 6th is sampled, never fed) through 2 sparse layers of top-2."""
    options = dict(skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=4 * 2**20, dtype="float32")
    async with AsyncEngine.start(model=str(qwen3_moe.path), **options) as engine:
        stat_logger = PrometheusStatLogger(engine.config, model_name="moe")
        engine.add_stat_logger(stat_logger)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        with anyio.fail_after(60):
            [_ async for _ in engine.generate({"prompt_token_ids": [5, 6, 7, 8]}, params)]
    got = samples(stat_logger)
    counts = [value(stat_logger, "asyncengine:moe_expert_tokens_total", got, expert=str(e)) for e in range(8)]
    assert sum(counts) == (4 + 5) * 2 * 2 and max(counts) < sum(counts)


# vLLM's names for our metrics, as vLLM's PrometheusStatLogger (vllm/v1/metrics/loggers.py) exposes them.
VLLM_GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:gpu_cache_usage_perc"]
VLLM_COUNTERS = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]
VLLM_HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                   "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                   "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                   "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens",
                   "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
                   "vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:iteration_tokens_total"]


def buckets_of(stat_logger: PrometheusStatLogger, name: str) -> list[float]:
    return sorted(float(dict(labels)["le"]) for (sample, labels), _ in samples(stat_logger).items()
                  if sample == f"{name}_bucket" and dict(labels)["le"] != "+Inf")


def test_every_vllm_name_is_exposed_beside_ours_with_vllms_labels_and_buckets():
    stat_logger = PrometheusStatLogger(model_name="tiny", max_model_len=1000)
    got = samples(stat_logger)
    for name in VLLM_GAUGES + VLLM_COUNTERS:
        assert value(stat_logger, name, got, engine="0") == 0, name
    for name in VLLM_HISTOGRAMS:
        assert value(stat_logger, f"{name}_count", got, engine="0") == 0, name
    for reason in ("stop", "length", "abort"):
        assert value(stat_logger, "vllm:request_success_total", got, engine="0", finished_reason=reason) == 0
    # vLLM's buckets, which differ from ours where ours reach further down.
    assert buckets_of(stat_logger, "vllm:time_to_first_token_seconds")[-1] == 2560.0
    assert buckets_of(stat_logger, "vllm:inter_token_latency_seconds")[0] == 0.01
    assert buckets_of(stat_logger, "asyncengine:inter_token_latency_seconds")[0] == 0.001  # ours kept
    assert buckets_of(stat_logger, "vllm:e2e_request_latency_seconds")[:3] == [0.3, 0.5, 0.8]
    assert buckets_of(stat_logger, "vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert buckets_of(stat_logger, "vllm:request_params_n") == [1, 2, 5, 10, 20]
    # Every new metric has our name too (../shared/ARCHITECTURE.md: ours always, vLLM's where it has one).
    for name in VLLM_GAUGES + VLLM_COUNTERS + VLLM_HISTOGRAMS:
        if name not in ("vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"):  # older vLLM names
            ours = name.replace("vllm:", "asyncengine:")
            assert any(sample.startswith(ours) for sample, _ in got), ours


def test_a_finished_request_lands_in_both_names_with_its_phases():
    stat_logger = PrometheusStatLogger(model_name="m", max_model_len=512)
    done = FinishedRequestStats(finish_reason="stop", e2e_latency=3.0, num_prompt_tokens=7, num_generation_tokens=5,
                                time_to_first_token=1.5, queued_time=1.0, prefill_time=0.5, decode_time=1.5,
                                inference_time=2.0, max_tokens=64)
    stat_logger.record(None, IterationStats(num_prompt_tokens=7, num_generation_tokens=1, time_to_first_tokens=[1.5],
                                            inter_token_latencies=[0.02, 0.04], n_params=[2],
                                            max_num_generation_tokens=[5], finished_requests=[done]))
    got = samples(stat_logger)
    for prefix in ("asyncengine:", "vllm:"):
        labels = {} if prefix == "asyncengine:" else {"engine": "0"}
        assert value(stat_logger, f"{prefix}request_success_total", got, finished_reason="stop", **labels) == 1
        assert value(stat_logger, f"{prefix}request_queue_time_seconds_sum", got, **labels) == 1.0
        assert value(stat_logger, f"{prefix}request_prefill_time_seconds_sum", got, **labels) == 0.5
        assert value(stat_logger, f"{prefix}request_decode_time_seconds_sum", got, **labels) == 1.5
        assert value(stat_logger, f"{prefix}request_inference_time_seconds_sum", got, **labels) == 2.0
        assert value(stat_logger, f"{prefix}request_time_per_output_token_seconds_sum", got, **labels) == 1.5 / 4
        assert value(stat_logger, f"{prefix}request_prompt_tokens_sum", got, **labels) == 7
        assert value(stat_logger, f"{prefix}request_generation_tokens_sum", got, **labels) == 5
        assert value(stat_logger, f"{prefix}request_params_max_tokens_sum", got, **labels) == 64
        assert value(stat_logger, f"{prefix}request_params_n_sum", got, **labels) == 2
        assert value(stat_logger, f"{prefix}request_max_num_generation_tokens_sum", got, **labels) == 5
        assert value(stat_logger, f"{prefix}iteration_tokens_total_sum", got, **labels) == 8
        assert value(stat_logger, f"{prefix}inter_token_latency_seconds_count", got, **labels) == 2
    assert value(stat_logger, "vllm:time_per_output_token_seconds_sum", got, engine="0") == pytest.approx(0.06)


def test_scheduler_totals_become_counters_in_both_names_and_the_cache_config_is_published():
    stat_logger = PrometheusStatLogger(EngineConfig(served_model_name="m", block_size=32), model_name="m")
    assert not any(name == "vllm:cache_config_info" for name, _ in samples(stat_logger))  # blocks unknown yet
    stat_logger.update_scheduler_stats(SchedulerStats(num_preemptions=2, prefix_cache_queries=40, prefix_cache_hits=16,
                                                      num_blocks=99))
    stat_logger.update_scheduler_stats(SchedulerStats(num_preemptions=3, prefix_cache_queries=40, prefix_cache_hits=16,
                                                      num_blocks=99))  # a scrape's stats: only what grew
    got = samples(stat_logger)
    assert value(stat_logger, "asyncengine:num_preemptions_total", got) == 3
    assert value(stat_logger, "vllm:num_preemptions_total", got, engine="0") == 3
    assert value(stat_logger, "vllm:prefix_cache_queries_total", got, engine="0") == 40
    assert value(stat_logger, "vllm:prefix_cache_hits_total", got, engine="0") == 16
    ((labels, info),) = [(dict(k), v) for (n, k), v in got.items() if n == "vllm:cache_config_info"]
    assert info == 1
    assert {key: labels[key] for key in ("num_gpu_blocks", "block_size", "enable_prefix_caching", "engine")} == \
        {"num_gpu_blocks": "99", "block_size": "32", "enable_prefix_caching": "True", "engine": "0"}


def test_tokens_per_expert_become_one_counter_per_expert():
    stat_logger = PrometheusStatLogger(model_name="m")
    assert not [name for name, _ in samples(stat_logger) if "moe_expert" in name]  # no experts: no series
    stat_logger.update_scheduler_stats(SchedulerStats(expert_tokens=[5, 0, 3, 0]))
    stat_logger.update_scheduler_stats(SchedulerStats(expert_tokens=[5, 0, 3, 0]))  # a scrape after the step
    table = samples(stat_logger)
    assert [value(stat_logger, "asyncengine:moe_expert_tokens_total", table, expert=str(e)) for e in range(4)] == \
        [5, 0, 3, 0]  # an expert no token chose shows as 0: the imbalance is what an operator looks for
    stat_logger.update_scheduler_stats(SchedulerStats(expert_tokens=[6, 2, 3, 0]))
    table = samples(stat_logger)
    assert [value(stat_logger, "asyncengine:moe_expert_tokens_total", table, expert=str(e)) for e in range(4)] == \
        [6, 2, 3, 0]


def test_tokens_per_expert_carry_the_engine_label_with_data_parallelism():
    stat_logger = PrometheusStatLogger(EngineConfig(served_model_name="m", data_parallel_size=2))
    stat_logger.update_scheduler_stats(SchedulerStats(expert_tokens=[4, 4], engines=[
        SchedulerStats(engine_index=0, expert_tokens=[1, 3]), SchedulerStats(engine_index=1, expert_tokens=[3, 1])]))
    table = samples(stat_logger)
    assert value(stat_logger, "asyncengine:moe_expert_tokens_total", table, engine="1", expert="0") == 3
    assert value(stat_logger, "asyncengine:moe_expert_tokens_total", table, engine="0", expert="1") == 3
