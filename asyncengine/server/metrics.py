"""PrometheusStatLogger: the engine's stats as Prometheus metrics, for the server's GET /metrics.

Each logger owns its own CollectorRegistry, never prometheus_client's global one: several servers
(and engines) may live in one process, in tests above all, and metrics registered twice in one
registry raise. Every metric carries a `model_name` label, as vLLM's do. Each is published under our
`asyncengine:` name and, where vLLM has the same metric, under vLLM's `vllm:` name too, with vLLM's labels
and buckets (metric_families.py), so vLLM's dashboards and alerts read this server unchanged.

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

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from asyncengine.frontend.iteration_stats import FinishedRequestStats, IterationStats
from asyncengine.interfaces.stat_logger import StatLoggerBase
from asyncengine.config.model import DEFAULT_MODEL_NAME
from asyncengine.server.metric_families import (
    ITERATION_TOKENS_BUCKETS, PARAMS_N_BUCKETS, VLLM_INTER_TOKEN_BUCKETS, VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TTFT_BUCKETS, Families, TwinChild, one_two_five_buckets,
)
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
# The scheduler's running totals that become counters (update_scheduler_stats): SchedulerStats field,
# our name, vLLM's names, documentation.
SCHEDULER_TOTALS = (
    ("num_prompt_tokens_computed", "asyncengine:prompt_tokens_computed", (),
     "Prompt tokens computed in prefill steps (a preempted request's recomputation counts again)."),
    ("num_kv_connector_loaded_tokens", "asyncengine:kv_connector_loaded_tokens", (),
     "Prompt tokens whose KV a KV connector supplied, so that no prefill computed them."),
    ("num_preemptions", "asyncengine:num_preemptions_total", ("vllm:num_preemptions_total",),
     "Preemptions: running requests sent back to wait, their KV blocks freed."),
    ("prefix_cache_queries", "asyncengine:prefix_cache_queries_total", ("vllm:prefix_cache_queries_total",),
     "Prefix cache queries, in prompt tokens looked up."),
    ("prefix_cache_hits", "asyncengine:prefix_cache_hits_total", ("vllm:prefix_cache_hits_total",),
     "Prefix cache hits, in prompt tokens found cached."),
    # Speculative decoding (docs/speculative_decoding.md): vLLM's counters; zero without speculation.
    ("spec_decode_num_drafts", "asyncengine:spec_decode_num_drafts_total", ("vllm:spec_decode_num_drafts_total",),
     "Speculative decoding: verifications, one per request and step that verified drafts."),
    ("spec_decode_num_draft_tokens", "asyncengine:spec_decode_num_draft_tokens_total",
     ("vllm:spec_decode_num_draft_tokens_total",), "Speculative decoding: draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "asyncengine:spec_decode_num_accepted_tokens_total",
     ("vllm:spec_decode_num_accepted_tokens_total",), "Speculative decoding: draft tokens accepted."),
)
# The scheduler's running totals kept per index (a list in SchedulerStats): field, the label the index goes
# under, our name, vLLM's names, documentation. One series per index, as many as the model or k gives.
SCHEDULER_INDEXED_TOTALS = (
    # Mixture-of-experts models: the load per expert, summed over the MoE layers; vLLM exports none.
    ("expert_tokens", "expert", "asyncengine:moe_expert_tokens_total", (),
     "Tokens routed to each expert of a mixture-of-experts model, summed over its MoE layers (a token counts "
     "once per expert it chose)."),
    ("spec_decode_num_accepted_tokens_per_pos", "position", "asyncengine:spec_decode_num_accepted_tokens_per_pos_total",
     ("vllm:spec_decode_num_accepted_tokens_per_pos_total",),
     "Speculative decoding: draft tokens accepted at each draft position (0: a step's first draft)."),
)


class PrometheusStatLogger(StatLoggerBase):
    """`record` feeds the counters and histograms, `update_scheduler_stats` the gauges, `render` the
    text exposition format. `model_name`: the label's value (default: the config's served model name);
    `max_model_len`: the model's resolved context length (default: the config's, else 32768)."""

    def __init__(self, engine_config: Any = None, *, model_name: str | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__(engine_config)
        if model_name is None:
            model_name = _served_model_name(engine_config)
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"PrometheusStatLogger: model_name must be a non-empty string, got {model_name!r}")
        self.model_name = model_name
        self.engine_config = engine_config
        self.registry = CollectorRegistry()
        families = Families(self.registry)
        labels = ["model_name"]
        # The token-count histograms' buckets reach max_model_len (the resolved one, from the server).
        max_model_len = max_model_len or int(getattr(engine_config, "max_model_len", None) or 0) or 32768

        # With data parallelism the scheduler's figures are each engine core's, under an `engine` label
        # (vLLM's); the frontend's (tokens, latencies, finished requests) stay one series for the server.
        num_engines = getattr(engine_config, "data_parallel_size", 1) if engine_config is not None else 1
        self._per_engine = num_engines > 1
        self._engine_series: dict[int, _SchedulerSeries] = {}
        scheduler_labels = labels + (["engine"] if self._per_engine else [])
        self._scheduler_families = {
            "running": families.gauge("asyncengine:num_requests_running",
                                      "Requests the scheduler is running (in the batch).", scheduler_labels,
                                      ["vllm:num_requests_running"]),
            "waiting": families.gauge("asyncengine:num_requests_waiting",
                                      "Requests waiting in the scheduler for a place in the batch.", scheduler_labels,
                                      ["vllm:num_requests_waiting"]),
            # vllm:gpu_cache_usage_perc: vLLM's older name, which its earlier published dashboard queries.
            "kv": families.gauge("asyncengine:kv_cache_usage_perc",
                                 "Fraction of KV-cache blocks in use: 0 is empty, 1 is full.", scheduler_labels,
                                 ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]),
            # The compiled-grammar cache (ours only: vLLM has no such metric), within --structured-outputs-cache-bytes.
            "grammar_bytes": families.gauge("asyncengine:structured_outputs_cache_bytes",
                                            "Bytes the compiled grammars in the structured-output cache hold (as "
                                            "charged to its budget).", scheduler_labels),
            "grammar_entries": families.gauge("asyncengine:structured_outputs_cache_entries",
                                              "Compiled grammars in the structured-output cache.", scheduler_labels),
            # The workers' encoder cache (engine_core/encoder_cache.py). Ours only: vLLM's SchedulerStats had an
            # encoder_cache_usage field but never published it as a metric.
            "encoder_entries": families.gauge("asyncengine:encoder_cache_entries",
                                              "Multimodal items (images) whose vision-encoder outputs the workers "
                                              "hold: 0 when no request runs.", scheduler_labels),
            "encoder_rows": families.gauge("asyncengine:encoder_cache_rows",
                                           "Embedding rows the encoder cache holds, counted against "
                                           "encoder_cache_size.", scheduler_labels),
        }
        # The scheduler keeps totals; these counters follow them (see update_scheduler_stats).
        self._scheduler_totals = {field_name: families.counter(ours, doc, scheduler_labels, vllm)
                                  for field_name, ours, vllm, doc in SCHEDULER_TOTALS}
        # Totals per expert or draft position: one series per index (bounded by the model or by k, not by traffic).
        self._indexed_totals = {field_name: (label, families.counter(ours, doc, scheduler_labels, vllm, extra=[label]))
                                for field_name, label, ours, vllm, doc in SCHEDULER_INDEXED_TOTALS}
        self._engine_up = Gauge("asyncengine:engine_up",
                                "1 while the engine core (by data-parallel index) is alive, 0 once it has died.",
                                labels + ["engine"], registry=self.registry)
        # vLLM's cache_config_info: a gauge at 1 whose labels are the KV cache's configuration, set once the
        # engine core's stats say how many blocks it has.
        self._cache_config_info = families.gauge(
            "asyncengine:cache_config_info", "The KV cache's configuration, in the labels.", labels,
            ["vllm:cache_config_info"], extra=list(CACHE_CONFIG_LABELS))
        self._cache_config_set: set[int] = set()
        self._dead_engines: set[int] = set()
        for index in range(num_engines):
            self._series(index)  # every engine's series from the start: zeros rather than missing series
            self._engine_up.labels(model_name, str(index)).set(1)
        first = self._engine_series[0]
        self.num_requests_running = first.running
        self.num_requests_waiting = first.waiting
        self.kv_cache_usage_perc = first.kv
        self.prompt_tokens_computed = first.counters["num_prompt_tokens_computed"]
        self.kv_connector_loaded_tokens = first.counters["num_kv_connector_loaded_tokens"]

        # The frontend's metrics: one series for the server (engine "0" under vLLM's names).
        server = {"model_name": model_name, "engine": "0"}

        def counter(name: str, doc: str) -> TwinChild:
            return families.counter(name, doc, labels, [name.replace("asyncengine:", "vllm:")]).labels(**server)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], vllm_buckets: tuple[float, ...],
                      *also: str) -> TwinChild:
            return families.histogram(name, doc, labels, buckets, [name.replace("asyncengine:", "vllm:"), *also],
                                      vllm_buckets).labels(**server)

        self.prompt_tokens = counter("asyncengine:prompt_tokens_total",
                                     "Prompt tokens of requests whose prefill completed.")
        self.generation_tokens = counter("asyncengine:generation_tokens_total", "Generated tokens.")
        self._request_success = families.counter(
            "asyncengine:request_success", "Requests (completions, one per n) that finished, by finish reason.",
            labels, ["vllm:request_success"], extra=["finished_reason"])
        self.request_success = {reason: self._request_success.labels(**server, finished_reason=reason)
                                for reason in FINISH_REASONS}
        self.time_to_first_token = histogram(
            "asyncengine:time_to_first_token_seconds", "Seconds from a request's arrival to its first token.",
            TTFT_BUCKETS, VLLM_TTFT_BUCKETS)
        # vllm:time_per_output_token_seconds: vLLM's older name of the same figure, still on its dashboards.
        self.inter_token_latency = histogram(
            "asyncengine:inter_token_latency_seconds", "Seconds between a request's successive steps with tokens.",
            ITL_BUCKETS, VLLM_INTER_TOKEN_BUCKETS, "vllm:time_per_output_token_seconds")
        self.e2e_request_latency = histogram(
            "asyncengine:e2e_request_latency_seconds", "Seconds from a request's arrival to its end.", E2E_BUCKETS,
            VLLM_REQUEST_LATENCY_BUCKETS)
        phases = {
            "queue": "Seconds a request waited, from its arrival to the step that first scheduled it.",
            "prefill": "Seconds from a request's first scheduled step to its first token.",
            "decode": "Seconds from a request's first token to its end.",
            "inference": "Seconds from a request's first scheduled step to its end (prefill and decode).",
        }
        self.request_phase_time = {
            phase: histogram(f"asyncengine:request_{phase}_time_seconds", doc, VLLM_REQUEST_LATENCY_BUCKETS,
                             VLLM_REQUEST_LATENCY_BUCKETS)
            for phase, doc in phases.items()
        }
        self.request_time_per_output_token = histogram(
            "asyncengine:request_time_per_output_token_seconds",
            "Per finished request: its decode time over its generated tokens after the first.",
            VLLM_INTER_TOKEN_BUCKETS, VLLM_INTER_TOKEN_BUCKETS)
        token_buckets = tuple(float(b) for b in one_two_five_buckets(max_model_len))
        self.request_prompt_tokens = histogram("asyncengine:request_prompt_tokens",
                                               "Prompt tokens per finished request.", token_buckets, token_buckets)
        self.request_generation_tokens = histogram("asyncengine:request_generation_tokens",
                                                   "Generated tokens per finished request.", token_buckets,
                                                   token_buckets)
        self.request_max_num_generation_tokens = histogram(
            "asyncengine:request_max_num_generation_tokens",
            "Per prompt whose completions all finished: the most tokens one of them generated.", token_buckets,
            token_buckets)
        self.request_params_n = histogram("asyncengine:request_params_n", "The n of each request (per prompt).",
                                          PARAMS_N_BUCKETS, PARAMS_N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "asyncengine:request_params_max_tokens", "The max_tokens each finished request ran with.", token_buckets,
            token_buckets)
        self.iteration_tokens = histogram(
            "asyncengine:iteration_tokens_total", "Tokens per engine step (prompt tokens of completed prefills and "
            "generated tokens).", ITERATION_TOKENS_BUCKETS, ITERATION_TOKENS_BUCKETS)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.update_scheduler_stats(scheduler_stats)
        if iteration_stats is None:
            return
        if iteration_stats.num_prompt_tokens:
            self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        if iteration_stats.num_generation_tokens:
            self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        step_tokens = iteration_stats.num_prompt_tokens + iteration_stats.num_generation_tokens
        if step_tokens:
            self.iteration_tokens.observe(step_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for n in iteration_stats.n_params:
            self.request_params_n.observe(n)
        for max_generated in iteration_stats.max_num_generation_tokens:
            self.request_max_num_generation_tokens.observe(max_generated)
        for finished in iteration_stats.finished_requests:
            self._record_finished(finished)

    def _record_finished(self, finished: FinishedRequestStats) -> None:
        reason = finished.finish_reason
        child = self.request_success.get(reason)
        if child is None:  # a reason added to the engine later still gets counted, under its name
            child = self.request_success[reason] = self._request_success.labels(
                model_name=self.model_name, engine="0", finished_reason=reason)
        child.inc()
        self.e2e_request_latency.observe(finished.e2e_latency)
        times = self.request_phase_time
        times["queue"].observe(finished.queued_time)
        times["prefill"].observe(finished.prefill_time)
        times["decode"].observe(finished.decode_time)
        times["inference"].observe(finished.inference_time)
        if finished.num_generation_tokens > 1:
            self.request_time_per_output_token.observe(finished.decode_time / (finished.num_generation_tokens - 1))
        self.request_prompt_tokens.observe(finished.num_prompt_tokens)
        self.request_generation_tokens.observe(finished.num_generation_tokens)
        if finished.max_tokens:
            self.request_params_max_tokens.observe(finished.max_tokens)

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
        series.encoder_entries.set(stats.encoder_cache_entries)
        series.encoder_rows.set(stats.encoder_cache_rows)
        # Counters from the scheduler's totals: each stats object may be seen more than once (a step's,
        # then a scrape's), so add what grew since the last one.
        for name, counter in series.counters.items():
            total = getattr(stats, name)
            if total > series.totals.get(name, 0):
                counter.inc(total - series.totals.get(name, 0))
                series.totals[name] = total
        for field_name in self._indexed_totals:
            totals = getattr(stats, field_name)
            if totals is not None:
                self._record_indexed_totals(series, index, field_name, totals)
        if stats.num_blocks and index not in self._cache_config_set:
            self._cache_config_set.add(index)
            self._cache_config_info.labels(model_name=self.model_name, engine=str(index),
                                           **cache_config_labels(self.engine_config, stats.num_blocks)).set(1)

    def _record_indexed_totals(self, series: _SchedulerSeries, index: int, field_name: str, totals: list[int]) -> None:
        """The per-index counters (experts, draft positions) from their totals: what grew since the last
        stats (each may be seen twice, a step's then a scrape's)."""
        label, family = self._indexed_totals[field_name]
        children = series.indexed_children.setdefault(field_name, [])
        last = series.indexed_totals.setdefault(field_name, [])
        while len(children) < len(totals):  # every index's series, a zero one included
            # (each family takes the labels it has: ours carries `engine` only with data parallelism, vLLM's always)
            children.append(family.labels(model_name=self.model_name, engine=str(index), **{label: str(len(children))}))
            last.append(0)
        for position, total in enumerate(totals):
            if total > last[position]:
                children[position].inc(total - last[position])
                last[position] = total

    def mark_engine_dead(self, engine_index: int) -> None:
        """Engine core `engine_index` has died: engine_up 0, its gauges 0 (it holds no request and no block)."""
        if engine_index in self._dead_engines:
            return
        self._dead_engines.add(engine_index)
        self._engine_up.labels(self.model_name, str(engine_index)).set(0)
        series = self._series(engine_index if self._per_engine else 0)
        for gauge in (series.running, series.waiting, series.kv, series.encoder_entries, series.encoder_rows):
            gauge.set(0)

    def _series(self, engine_index: int) -> _SchedulerSeries:
        series = self._engine_series.get(engine_index)
        if series is None:
            values = {"model_name": self.model_name, "engine": str(engine_index)}
            families = self._scheduler_families
            series = self._engine_series[engine_index] = _SchedulerSeries(
                running=families["running"].labels(**values), waiting=families["waiting"].labels(**values),
                kv=families["kv"].labels(**values), grammar_bytes=families["grammar_bytes"].labels(**values),
                grammar_entries=families["grammar_entries"].labels(**values),
                encoder_entries=families["encoder_entries"].labels(**values),
                encoder_rows=families["encoder_rows"].labels(**values),
                counters={name: twin.labels(**values) for name, twin in self._scheduler_totals.items()},
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
    encoder_entries: Any
    encoder_rows: Any
    counters: dict[str, Any]
    totals: dict[str, int] = field(default_factory=dict)  # the scheduler's last totals, by SchedulerStats field
    # SCHEDULER_INDEXED_TOTALS: by SchedulerStats field, the last totals per index and each index's counter.
    indexed_totals: dict[str, list[int]] = field(default_factory=dict)
    indexed_children: dict[str, list[Any]] = field(default_factory=dict)


def _served_model_name(engine_config: Any) -> str:
    """The name the server serves the model under, as ModelConfig derives it."""
    if engine_config is None:
        return DEFAULT_MODEL_NAME
    names = getattr(engine_config, "served_model_names", None) or [getattr(engine_config, "served_model_name", None)]
    return names[0] or getattr(engine_config, "model", None) or DEFAULT_MODEL_NAME


# vLLM's cache_config_info labels that mean something here (vLLM's CacheConfig field names).
CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                       "kv_cache_memory_bytes", "num_gpu_blocks", "num_gpu_blocks_override")


def cache_config_labels(engine_config: Any, num_blocks: int) -> dict[str, str]:
    """The label values of cache_config_info, as vLLM writes them (str() of each value)."""
    values = {name: str(getattr(engine_config, name, None)) for name in CACHE_CONFIG_LABELS}
    values["cache_dtype"] = str(getattr(engine_config, "kv_cache_dtype", "auto") or "auto")
    values["num_gpu_blocks"] = str(num_blocks)
    return values
