"""PrometheusStatLogger: the engine's stats as Prometheus metrics, for the server's GET /metrics.

Each logger owns its own CollectorRegistry, never prometheus_client's global one: several servers
(and engines) may live in one process, in tests above all, and metrics registered twice in one
registry raise. Every metric carries a `model_name` label, as vLLM's do, so dashboards built for
vLLM's metric shapes carry over with the `asyncengine:` prefix.

    stat_logger = PrometheusStatLogger(engine.config, model_name=engine.model_config.served_model_name)
    engine.add_stat_logger(stat_logger)
    ...  # on each scrape:
    stat_logger.update_scheduler_stats(await engine.get_scheduler_stats())
    body, content_type = stat_logger.render()

The gauges follow the scheduler stats of the last step, and the server refreshes them before each
scrape, so an idle engine shows zero running requests instead of the last busy step's count.
`asyncengine:engine_up{engine="i"}` is 1 while engine core i lives; once it is dead
(`mark_engine_dead`, from the server before each scrape) it is 0, that engine core's gauges are 0 and
stay so (its counters keep their totals, as Prometheus counters do), and stats that still arrive for
it are ignored. vLLM has no such metric, so it has only our name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from asyncengine.frontend.iteration_stats import IterationStats
from asyncengine.frontend.stat_loggers import StatLoggerBase
from asyncengine.loader.model_source import DEFAULT_MODEL_NAME
from asyncengine.wire.engine_core import FinishReason, SchedulerStats

# The finish reasons a request can end with; each gets its series up front, so a scrape shows zeros
# rather than missing series before the first request of that kind finishes.
FINISH_REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT)

# Bucket bounds in seconds. A small model on a CPU answers within milliseconds, a large one on a busy
# GPU may take minutes to finish a long request: each range spans both ends.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class PrometheusStatLogger(StatLoggerBase):
    """`record` feeds the counters and histograms, `update_scheduler_stats` the gauges, `render` the
    text exposition format. `model_name`: the label's value (default: the config's served model name)."""

    def __init__(self, engine_config: Any = None, *, model_name: str | None = None) -> None:
        super().__init__(engine_config)
        if model_name is None:
            model_name = _served_model_name(engine_config)
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"PrometheusStatLogger: model_name must be a non-empty string, got {model_name!r}")
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, documentation: str) -> Any:
            return Gauge(name, documentation, labels, registry=self.registry).labels(model_name)

        def counter(name: str, documentation: str) -> Any:
            # prometheus_client appends "_total" to a counter's name itself: give the bare name so the
            # exposed one is `name_total`, exactly once.
            return Counter(name.removesuffix("_total"), documentation, labels, registry=self.registry).labels(
                model_name
            )

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry).labels(model_name)

        # With data parallelism the scheduler's figures are each engine core's, under an `engine` label
        # (vLLM's); the frontend's (tokens, latencies, finished requests) stay one series for the server.
        num_engines = getattr(engine_config, "data_parallel_size", 1) if engine_config is not None else 1
        self._per_engine = num_engines > 1
        self._engine_series: dict[int, _SchedulerSeries] = {}
        scheduler_labels = labels + (["engine"] if self._per_engine else [])
        self._scheduler_families = {
            "running": Gauge("asyncengine:num_requests_running", "Requests the scheduler is running (in the batch).",
                             scheduler_labels, registry=self.registry),
            "waiting": Gauge("asyncengine:num_requests_waiting",
                             "Requests waiting in the scheduler for a place in the batch.", scheduler_labels,
                             registry=self.registry),
            "kv": Gauge("asyncengine:kv_cache_usage_perc", "Fraction of KV-cache blocks in use: 0 is empty, 1 is full.",
                        scheduler_labels, registry=self.registry),
            # The compiled-grammar cache (ours only: vLLM has no such metric), within --structured-outputs-cache-bytes.
            "grammar_bytes": Gauge("asyncengine:structured_outputs_cache_bytes",
                                   "Bytes the compiled grammars in the structured-output cache hold (as charged to "
                                   "its budget).", scheduler_labels, registry=self.registry),
            "grammar_entries": Gauge("asyncengine:structured_outputs_cache_entries",
                                     "Compiled grammars in the structured-output cache.", scheduler_labels,
                                     registry=self.registry),
            # Where prompt KV came from: computed in prefill steps, or supplied by a KV connector. The
            # scheduler keeps totals; these counters follow them (see update_scheduler_stats).
            "num_prompt_tokens_computed": Counter(
                "asyncengine:prompt_tokens_computed",
                "Prompt tokens computed in prefill steps (a preempted request's recomputation counts again).",
                scheduler_labels, registry=self.registry),
            "num_kv_connector_loaded_tokens": Counter(
                "asyncengine:kv_connector_loaded_tokens",
                "Prompt tokens whose KV a KV connector supplied, so that no prefill computed them.",
                scheduler_labels, registry=self.registry),
        }
        self._engine_up = Gauge("asyncengine:engine_up",
                                "1 while the engine core (by data-parallel index) is alive, 0 once it has died.",
                                labels + ["engine"], registry=self.registry)
        self._dead_engines: set[int] = set()
        for index in range(num_engines):
            self._series(index)  # every engine's series from the start: zeros rather than missing series
            self._engine_up.labels(model_name, str(index)).set(1)
        first = self._engine_series[0]
        self.num_requests_running = first.running
        self.num_requests_waiting = first.waiting
        self.kv_cache_usage_perc = first.kv
        self.prompt_tokens = counter(
            "asyncengine:prompt_tokens_total", "Prompt tokens of requests whose prefill completed."
        )
        self.generation_tokens = counter("asyncengine:generation_tokens_total", "Generated tokens.")
        self.prompt_tokens_computed = first.counters["num_prompt_tokens_computed"]
        self.kv_connector_loaded_tokens = first.counters["num_kv_connector_loaded_tokens"]
        request_success = Counter(
            "asyncengine:request_success",
            "Requests (completions, one per n) that finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {reason: request_success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._request_success_family = request_success
        self.time_to_first_token = histogram(
            "asyncengine:time_to_first_token_seconds", "Seconds from a request's arrival to its first token.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "asyncengine:inter_token_latency_seconds", "Seconds between a request's successive steps with tokens.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "asyncengine:e2e_request_latency_seconds", "Seconds from a request's arrival to its end.", E2E_BUCKETS
        )

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.update_scheduler_stats(scheduler_stats)
        if iteration_stats is None:
            return
        if iteration_stats.num_prompt_tokens:
            self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        if iteration_stats.num_generation_tokens:
            self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for finished in iteration_stats.finished_requests:
            reason = finished.finish_reason
            child = self.request_success.get(reason)
            if child is None:  # a reason added to the engine later still gets counted, under its name
                child = self.request_success[reason] = self._request_success_family.labels(self.model_name, reason)
            child.inc()
            self.e2e_request_latency.observe(finished.e2e_latency)

    def update_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Set the gauges from fresh scheduler stats (the server calls it right before each scrape). With
        data parallelism: one engine core's (`stats.engine_index`), or the sum with each one's in `engines`."""
        if self._per_engine and stats.engines is not None:
            for engine_stats in stats.engines:
                self.update_scheduler_stats(engine_stats)
            return
        index = stats.engine_index if self._per_engine else 0
        if index in self._dead_engines:
            return  # its last step's stats, arriving after its death: it runs nothing
        series = self._series(index)
        series.running.set(stats.num_running_reqs)
        series.waiting.set(stats.num_waiting_reqs)
        series.kv.set(stats.kv_cache_usage)
        series.grammar_bytes.set(stats.structured_outputs_cache_bytes)
        series.grammar_entries.set(stats.structured_outputs_cache_entries)
        # Counters from the scheduler's totals: each stats object may be seen more than once (a step's,
        # then a scrape's), so add what grew since the last one.
        for name, counter in series.counters.items():
            total = getattr(stats, name)
            if total > series.totals[name]:
                counter.inc(total - series.totals[name])
                series.totals[name] = total

    def mark_engine_dead(self, engine_index: int) -> None:
        """Engine core `engine_index` has died: engine_up 0, its gauges 0 (it holds no request and no block)."""
        if engine_index in self._dead_engines:
            return
        self._dead_engines.add(engine_index)
        self._engine_up.labels(self.model_name, str(engine_index)).set(0)
        series = self._series(engine_index if self._per_engine else 0)
        for gauge in (series.running, series.waiting, series.kv):
            gauge.set(0)

    def _series(self, engine_index: int) -> _SchedulerSeries:
        series = self._engine_series.get(engine_index)
        if series is None:
            values = [self.model_name] + ([str(engine_index)] if self._per_engine else [])
            families = self._scheduler_families
            series = self._engine_series[engine_index] = _SchedulerSeries(
                running=families["running"].labels(*values), waiting=families["waiting"].labels(*values),
                kv=families["kv"].labels(*values), grammar_bytes=families["grammar_bytes"].labels(*values),
                grammar_entries=families["grammar_entries"].labels(*values),
                counters={name: families[name].labels(*values)
                          for name in ("num_prompt_tokens_computed", "num_kv_connector_loaded_tokens")},
            )
        return series

    def render(self) -> tuple[bytes, str]:
        """The body and content type of a /metrics response (the text format, version 0.0.4: every
        Prometheus version reads it, and our metric names need none of the newer format's escaping)."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4


@dataclass
class _SchedulerSeries:
    """One engine core's scheduler metrics (the only ones without data parallelism)."""

    running: Any
    waiting: Any
    kv: Any
    grammar_bytes: Any
    grammar_entries: Any
    counters: dict[str, Any]
    totals: dict[str, int] = field(default_factory=lambda: {"num_prompt_tokens_computed": 0,
                                                            "num_kv_connector_loaded_tokens": 0})


def _served_model_name(engine_config: Any) -> str:
    """The name the server serves the model under, as ModelConfig derives it."""
    if engine_config is None:
        return DEFAULT_MODEL_NAME
    names = getattr(engine_config, "served_model_names", None) or [getattr(engine_config, "served_model_name", None)]
    return names[0] or getattr(engine_config, "model", None) or DEFAULT_MODEL_NAME
