"""Each metric under our name and, where vLLM has the same metric, under vLLM's name too (../shared
docs/architecture.md's rule), so that vLLM's Grafana dashboards and alerts read this server unchanged.

A `Twin` is one metric published as several Prometheus families in one registry: `asyncengine:<name>`
with our labels and buckets (kept as they were: existing dashboards and alerts of ours must not break),
and each vLLM name with vLLM's labels (`model_name`, `engine`) and vLLM's buckets (vllm/v1/metrics/
loggers.py). Recording goes to every family at once.

vLLM's `engine` label is the engine core's index. Scheduler metrics (requests running and waiting, KV
cache, preemptions, prefix cache) carry each engine core's; the frontend's (tokens, latencies, finished
requests) are measured here for the whole server and carry engine "0", as vLLM's do with one engine core.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

VLLM_LABELS = ("model_name", "engine")

# vLLM's buckets, by metric (seconds, or tokens).
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                            10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets, up to max_model_len)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class Twin:
    """One metric as several families (ours and vLLM's); `labels(...)` gives the child that records."""

    def __init__(self, families: Sequence[tuple[Any, tuple[str, ...]]]) -> None:
        self.families = list(families)  # (family, its label names)

    def labels(self, **values: str) -> TwinChild:
        """Each family's child for these label values (a family takes the ones among its label names)."""
        return TwinChild([family.labels(*(values[name] for name in names)) for family, names in self.families])


class TwinChild:
    def __init__(self, children: list[Any]) -> None:
        self.children = children

    def inc(self, amount: float = 1.0) -> None:
        for child in self.children:
            child.inc(amount)

    def set(self, value: float) -> None:
        for child in self.children:
            child.set(value)

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)


class Families:
    """Makes twins in one registry. `ours`: our name and label names; `vllm`: vLLM's names (none: ours only),
    whose labels are VLLM_LABELS plus `extra` (such as finished_reason, which ours carry too)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def gauge(self, ours: str, doc: str, labels: Sequence[str], vllm: Sequence[str] = (),
              extra: Sequence[str] = ()) -> Twin:
        return self._twin(Gauge, ours, doc, labels, vllm, extra)

    def counter(self, ours: str, doc: str, labels: Sequence[str], vllm: Sequence[str] = (),
                extra: Sequence[str] = ()) -> Twin:
        # prometheus_client appends "_total" to a counter's name itself: give the bare names so the
        # exposed ones end in `_total` exactly once.
        return self._twin(Counter, ours.removesuffix("_total"), doc, labels,
                          [name.removesuffix("_total") for name in vllm], extra)

    def histogram(self, ours: str, doc: str, labels: Sequence[str], buckets: Sequence[float],
                  vllm: Sequence[str] = (), vllm_buckets: Sequence[float] | None = None) -> Twin:
        families: list[tuple[Any, tuple[str, ...]]] = [
            (Histogram(ours, doc, list(labels), buckets=list(buckets), registry=self.registry), tuple(labels))]
        for name in vllm:
            families.append((Histogram(name, doc, list(VLLM_LABELS), buckets=list(vllm_buckets or buckets),
                                       registry=self.registry), VLLM_LABELS))
        return Twin(families)

    def _twin(self, cls: Any, ours: str, doc: str, labels: Sequence[str], vllm: Sequence[str],
              extra: Sequence[str]) -> Twin:
        families: list[tuple[Any, tuple[str, ...]]] = [
            (cls(ours, doc, [*labels, *extra], registry=self.registry), (*labels, *extra))]
        for name in vllm:
            names = (*VLLM_LABELS, *extra)
            families.append((cls(name, doc, list(names), registry=self.registry), names))
        return Twin(families)
