"""Prometheus metrics for the guard and the dedup store (extra ``metrics``: prometheus-client).

Per message (from :class:`PrometheusObserver`, labels ``consumer`` and ``store``)::

    idemq_messages_total{outcome}          processed | duplicate | in_progress |
                                           payload_mismatch | error
    idemq_errors_total{kind}               handler | store | store_unavailable | lease_lost |
                                           invalid_message | payload_mismatch
    idemq_dead_lettered_total              messages the worker dead-lettered
    idemq_claim_duration_seconds           histogram: claim round trip (incl. BEGIN in
                                           transactional mode)
    idemq_handler_duration_seconds         histogram: the handler's own run

Per store (from :class:`StoreCollector`, label ``store``; read on scrape, at most every
``min_interval_s``, because ``stats()`` scans the table)::

    idemq_records{status}                  processing | processed
    idemq_stuck_leases                     PROCESSING records whose lease has expired
    idemq_oldest_processing_age_seconds    age of the oldest PROCESSING record (0 if none)
    idemq_store_size_bytes                 the backend's size estimate (absent if unknown)
    idemq_store_up                         1 if the last stats() worked, else 0

Per outbox (from :class:`OutboxCollector`, label ``outbox``: the table name)::

    idemq_outbox_pending                      rows not yet published
    idemq_outbox_oldest_pending_age_seconds   age of the oldest of them (0 if none): the lag
    idemq_outbox_dead_rows                    rows in ``<table>_dead`` now
    idemq_outbox_published_total              rows the given relays published (counter)
    idemq_outbox_dead_total                   rows the given relays moved to dead (counter)

Labels never carry credentials: ``store`` is :func:`idemq.stores.store_label` (dialect and
table, or ``redis/<prefix>``), never a URL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from idemq.errors import ConfigurationError, StoreError
from idemq.guard.core import Outcome, Status
from idemq.guard.probes import Observer
from idemq.observe.labels import error_kind, outcome_label
from idemq.stores import store_label as _label
from idemq.stores.base import StoreStats

try:
    import prometheus_client
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "idemq.observe.prometheus needs prometheus-client: pip install 'idemq[metrics]'"
    ) from exc

__all__ = [
    "LATENCY_BUCKETS_S",
    "OutboxCollector",
    "PrometheusObserver",
    "StoreCollector",
    "serve_metrics",
]

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
"""Histogram buckets (seconds): a claim is typically sub-millisecond to a few ms."""

_LABELS = ("consumer", "store")


class PrometheusObserver(Observer):
    """Counts and times every message the guard sees; pass it as ``observer=`` to the guard.

    ``registry``: where the metrics are registered (default: prometheus-client's global one;
    one observer per registry). ``store_label``: the ``store`` label, e.g.
    ``idemq.stores.store_label(store)``.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, store_label: str = "default"
    ) -> None:
        self.registry = registry if registry is not None else prometheus_client.REGISTRY
        self.store_label = store_label
        reg = self.registry
        self.messages = prometheus_client.Counter(
            "idemq_messages",
            "Messages through the guard, by outcome.",
            [*_LABELS, "outcome"],
            registry=reg,
        )
        self.errors = prometheus_client.Counter(
            "idemq_errors", "Guard calls that raised, by kind.", [*_LABELS, "kind"], registry=reg
        )
        self.dead_letters = prometheus_client.Counter(
            "idemq_dead_lettered", "Messages the worker dead-lettered.", _LABELS, registry=reg
        )
        self.claim_seconds = prometheus_client.Histogram(
            "idemq_claim_duration_seconds",
            "Claim latency.",
            _LABELS,
            buckets=LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.handler_seconds = prometheus_client.Histogram(
            "idemq_handler_duration_seconds",
            "Handler run time.",
            _LABELS,
            buckets=LATENCY_BUCKETS_S,
            registry=reg,
        )

    def claim_done(
        self, consumer: str, message_id: str, seconds: float, status: Status | None
    ) -> None:
        """Observe the claim latency."""
        self.claim_seconds.labels(consumer, self.store_label).observe(seconds)

    def handler_done(
        self, consumer: str, message_id: str, seconds: float, error: BaseException | None
    ) -> None:
        """Observe the handler's run time (failed runs included)."""
        self.handler_seconds.labels(consumer, self.store_label).observe(seconds)

    def finished(
        self,
        consumer: str,
        message_id: str,
        seconds: float,
        outcome: Outcome[Any] | None,
        error: BaseException | None,
    ) -> None:
        """Count the outcome, and the error's kind when there was one."""
        self.messages.labels(consumer, self.store_label, outcome_label(outcome, error)).inc()
        failure = error if error is not None else (outcome.error if outcome else None)
        if failure is not None:
            self.errors.labels(consumer, self.store_label, error_kind(failure)).inc()

    def dead_lettered(self, consumer: str, message_id: str, reason: str) -> None:
        """Count a dead letter."""
        self.dead_letters.labels(consumer, self.store_label).inc()


class StoreCollector(Collector):
    """Store gauges read from ``store.stats()`` on scrape, at most once per ``min_interval_s``.

    Register it: ``registry.register(StoreCollector(store))``. Sync stores only (a scrape runs on
    the HTTP server's thread); for an async store, give it a sync twin on the same URL.
    ``clock_s`` (monotonic seconds) and ``now_ms`` (epoch ms, for stuck leases) are injectable.
    """

    def __init__(
        self,
        store: Any,
        *,
        store_label: str | None = None,
        min_interval_s: float = 15.0,
        clock_s: Callable[[], float] = time.monotonic,
        now_ms: Callable[[], int] | None = None,
    ) -> None:
        if not hasattr(store, "stats"):
            raise ConfigurationError(f"{type(store).__name__} has no stats()")
        self.store = store
        self.label = store_label or _label(store)
        self.min_interval_s = min_interval_s
        self._clock_s = clock_s
        self._now_ms = now_ms
        self._lock = threading.Lock()  # two concurrent scrapes must not both scan the table
        self._read_at_s: float | None = None
        self._last: StoreStats | None = None
        self.reads = 0  # how many times stats() actually ran (rate limiting is tested on it)

    def _stats(self) -> StoreStats | None:
        with self._lock:
            now_s = self._clock_s()
            if self._read_at_s is not None and now_s - self._read_at_s < self.min_interval_s:
                return self._last
            self._read_at_s = now_s
            self.reads += 1
            try:
                now_ms = None if self._now_ms is None else self._now_ms()
                self._last = self.store.stats(now_ms=now_ms)
            except StoreError:
                # A scrape must not fail because the store is down: say so in idemq_store_up.
                self._last = None
            return self._last

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The gauges (called by prometheus-client on every scrape)."""
        stats = self._stats()
        labels = [self.label]
        up = GaugeMetricFamily("idemq_store_up", "1 if stats() worked.", labels=["store"])
        up.add_metric(labels, 0 if stats is None else 1)
        yield up
        if stats is None:
            return
        records = GaugeMetricFamily(
            "idemq_records", "Records in the store, by status.", labels=["store", "status"]
        )
        records.add_metric([*labels, "processing"], stats.processing)
        records.add_metric([*labels, "processed"], stats.processed)
        yield records
        stuck = GaugeMetricFamily(
            "idemq_stuck_leases", "PROCESSING records with an expired lease.", labels=["store"]
        )
        stuck.add_metric(labels, stats.stuck)
        yield stuck
        oldest = GaugeMetricFamily(
            "idemq_oldest_processing_age_seconds",
            "Age of the oldest PROCESSING record (0 when none).",
            labels=["store"],
        )
        age_s = 0.0
        if stats.oldest_processing is not None:
            age_s = max(0.0, stats.now_ms / 1000 - stats.oldest_processing.timestamp())
        oldest.add_metric(labels, age_s)
        yield oldest
        if stats.size_bytes is not None:
            size = GaugeMetricFamily(
                "idemq_store_size_bytes",
                "Store size in bytes, as the backend estimates it.",
                labels=["store"],
            )
            size.add_metric(labels, stats.size_bytes)
            yield size


class OutboxCollector(Collector):
    """Outbox gauges (read on scrape, at most once per ``min_interval_s``) and the counters of
    ``relays``. Register it: ``registry.register(OutboxCollector(outbox, relays=[relay]))``."""

    def __init__(
        self,
        outbox: Any,
        *,
        relays: Sequence[Any] = (),
        min_interval_s: float = 15.0,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        from idemq.outbox import outbox_stats  # noqa: PLC0415 - the outbox floor is below

        self.outbox = outbox
        self.relays = list(relays)
        self.min_interval_s = min_interval_s
        self._read = outbox_stats
        self._clock_s = clock_s
        self._lock = threading.Lock()
        self._read_at_s: float | None = None
        self._last: Any = None

    def _stats(self) -> Any:
        with self._lock:
            now_s = self._clock_s()
            if self._read_at_s is None or now_s - self._read_at_s >= self.min_interval_s:
                self._read_at_s = now_s
                try:
                    self._last = self._read(self.outbox)
                except StoreError:
                    self._last = None  # a scrape must not fail because the database is down
            return self._last

    def collect(self) -> Iterator[Metric]:
        """The outbox's gauges and its relays' counters."""
        labels = [self.outbox.table]
        published = CounterMetricFamily(
            "idemq_outbox_published", "Rows published by the relays.", labels=["outbox"]
        )
        published.add_metric(labels, sum(r.published_total for r in self.relays))
        yield published
        dead_total = CounterMetricFamily(
            "idemq_outbox_dead", "Rows the relays moved to the dead table.", labels=["outbox"]
        )
        dead_total.add_metric(labels, sum(r.dead_total for r in self.relays))
        yield dead_total
        stats = self._stats()
        if stats is None:
            return
        for name, doc, value in (
            ("idemq_outbox_pending", "Rows not yet published.", stats.pending),
            (
                "idemq_outbox_oldest_pending_age_seconds",
                "Age of the oldest unpublished row (0 if none).",
                stats.oldest_pending_age_s,
            ),
            ("idemq_outbox_dead_rows", "Rows in the dead table now.", stats.dead),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["outbox"])
            gauge.add_metric(labels, value)
            yield gauge


def serve_metrics(
    port: int, *, registry: CollectorRegistry | None = None, addr: str = "0.0.0.0"
) -> Any:
    """Serve ``/metrics`` on ``port`` from a daemon thread; returns the HTTP server (call
    ``shutdown()`` on it to stop)."""
    reg = registry if registry is not None else prometheus_client.REGISTRY
    server, _thread = prometheus_client.start_http_server(port, addr=addr, registry=reg)
    return server
