"""Service metrics through OpenTelemetry, exposed in the Prometheus text format at `/metrics`.

Each worker owns its meter provider and a Prometheus registry of its own (never the process-wide
default), so two services in one process do not mix. Histograms and counters are recorded as
documents finish; gauges (queue depth, KV pool, consumer lag, in-flight) are read from the
service when scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds: a no-op pipeline answers in milliseconds, a CPU analysis takes minutes under load.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


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


class Metrics:
    def __init__(self, service_name: str, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reader = PrometheusMetricReader(registry=self.registry, disable_target_info=True)
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
            "deepanalyze.time_to_first_token", unit="s", description="Consumed to the first generated token."
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
        meter.create_observable_gauge("deepanalyze.engine.queue_depth", [self._queue_depth])
        meter.create_observable_gauge("deepanalyze.engine.running", [self._running])
        meter.create_observable_gauge("deepanalyze.in_flight", [self._in_flight])
        meter.create_observable_gauge("deepanalyze.kv_pool.used", [self._kv_used], unit="By")
        meter.create_observable_gauge("deepanalyze.kv_pool.total", [self._kv_total], unit="By")
        meter.create_observable_gauge(
            "deepanalyze.consumer.lag", [self._lag], description="Highwater minus committed offset."
        )

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
