"""Service metrics through OpenTelemetry, exposed in the Prometheus text format at `/metrics`.

Each worker owns its meter provider and a Prometheus registry of its own (never the process-wide
default), so two services in one process do not mix. Histograms and counters are recorded as
documents finish; gauges (queue depth, KV pool, consumer lag, in-flight) and the engine's running
totals (tokens generated, prefix-cache hits, preemptions, steps) are read from the service when
scraped. The registry also carries the process's own families (`process_*`: CPU, memory, open
files; `python_*`: the collector and the interpreter), like any Prometheus client. Every family has
HELP text; no series carries the `otel_scope_*` labels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds: a no-op pipeline answers in milliseconds, a CPU analysis takes minutes under load.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Seconds per generated token: ~1 ms on a GPU, ~0.1-1 s on a small CPU under load.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


@dataclass(frozen=True)
class Snapshot:
    """What the gauges read at scrape time."""

    queue_depth: int  # requests waiting in the engine
    running: int  # sequences in the engine's batch
    in_flight: int  # documents consumed and not yet answered
    kv_used_bytes: int
    kv_total_bytes: int
    lag: dict[tuple[str, int], int] = field(
        default_factory=dict
    )  # (topic, partition) -> highwater - committed
    # The engine's running totals since it started (labels and narratives alike).
    generated_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    accepted_drafts: int = 0


class Metrics:
    def __init__(self, service_name: str, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reader = PrometheusMetricReader(
            registry=self.registry, disable_target_info=True, scope_info_enabled=False
        )
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        views = [
            View(
                instrument_name="*duration", aggregation=ExplicitBucketHistogramAggregation(LATENCY_BUCKETS)
            ),
            View(
                instrument_name="*first_token",
                aggregation=ExplicitBucketHistogramAggregation(LATENCY_BUCKETS),
            ),
            View(
                instrument_name="*batch_size", aggregation=ExplicitBucketHistogramAggregation(BATCH_BUCKETS)
            ),
            View(
                instrument_name="*per_output_token",
                aggregation=ExplicitBucketHistogramAggregation(TOKEN_BUCKETS),
            ),
        ]
        self.provider = MeterProvider(
            metric_readers=[reader], resource=Resource.create({"service.name": service_name}), views=views
        )
        meter = self.provider.get_meter("deepanalyze")
        self._snapshot = snapshot
        self._scraped: Snapshot | None = None  # taken once per scrape, read by every gauge
        self.duration = meter.create_histogram(
            "deepanalyze.document.duration",
            unit="s",
            description="Consumed to answer published, per document.",
        )
        self.ttft = meter.create_histogram(
            "deepanalyze.time_to_first_token",
            unit="s",
            description="Consumed to the first generated token of the document's narrative.",
        )
        self.tpot = meter.create_histogram(
            "deepanalyze.time_per_output_token",
            unit="s",
            description="Decode time per generated token after the first, per document (first attempt).",
        )
        self.tokens = meter.create_counter(
            "deepanalyze.tokens",
            description="Tokens of the analyses published: type=input (prompt) or output (generated).",
        )
        self.batch_size = meter.create_histogram(
            "deepanalyze.engine.batch_size",
            description="Sequences in the engine step that read the document.",
        )
        self.documents = meter.create_counter(
            "deepanalyze.documents", description="Documents answered, by outcome (analysis or dead_letter)."
        )
        self.dead_letters = meter.create_counter(
            "deepanalyze.dead_letters", description="Dead letters published, by reason."
        )
        gauges = (
            ("deepanalyze.engine.queue_depth", self._queue_depth, "", "Requests waiting for the engine."),
            ("deepanalyze.engine.running", self._running, "", "Sequences in the engine's running batch."),
            ("deepanalyze.in_flight", self._in_flight, "", "Documents consumed and not yet answered."),
            ("deepanalyze.kv_pool.used", self._kv_used, "By", "KV cache pool bytes held by sequences."),
            ("deepanalyze.kv_pool.total", self._kv_total, "By", "KV cache pool bytes allocated."),
            ("deepanalyze.consumer.lag", self._lag, "", "Highwater minus committed offset, per partition."),
        )
        for name, callback, unit, description in gauges:
            meter.create_observable_gauge(name, [callback], unit=unit, description=description)
        totals = (
            ("deepanalyze.engine.generated_tokens", "generated_tokens", "Tokens the engine generated."),
            ("deepanalyze.engine.prefix_cache_hit_tokens", "prefix_hit_tokens",
             "Prompt tokens adopted from the prefix cache instead of computed."),
            ("deepanalyze.engine.preemptions", "preemptions", "Sequences preempted for want of KV blocks."),
            ("deepanalyze.engine.steps", "steps", "Forward passes the engine ran."),
            ("deepanalyze.engine.accepted_draft_tokens", "accepted_drafts",
             "Generated tokens that were draft tokens the model agreed with (no step of their own)."),
        )  # fmt: skip
        for name, attribute, description in totals:
            meter.create_observable_counter(name, [self._total(attribute)], description=description)

    def render(self) -> bytes:
        self._scraped = self._snapshot()
        try:
            return bytes(generate_latest(self.registry))
        finally:
            self._scraped = None

    def _current(self) -> Snapshot:
        return self._scraped if self._scraped is not None else self._snapshot()

    def shutdown(self) -> None:
        self.provider.shutdown()

    def _total(self, attribute: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(getattr(self._current(), attribute))]

        return observe

    def _queue_depth(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._current().queue_depth)]

    def _running(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._current().running)]

    def _in_flight(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._current().in_flight)]

    def _kv_used(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._current().kv_used_bytes)]

    def _kv_total(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._current().kv_total_bytes)]

    def _lag(self, _: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(lag, {"topic": topic, "partition": str(partition)})
            for (topic, partition), lag in sorted(self._current().lag.items())
        ]
