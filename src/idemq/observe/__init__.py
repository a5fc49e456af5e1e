"""Observers: watch the guard with logs, Prometheus metrics or OpenTelemetry traces.

An observer is handed to a guard (``Idempotency(store, observer=...)``); with none the guard pays
one attribute check per message. Write your own by subclassing :class:`Observer` and overriding
the plain callbacks, which arrive with their durations measured::

    class Audit(idemq.Observer):
        def finished(self, consumer, message_id, seconds, outcome, error):
            ...  # outcome.status is PROCESSED, DUPLICATE or IN_PROGRESS; error what was raised

The ready ones:

* :class:`LoggingObserver` (:mod:`idemq.observe.logs`): one structured record per message;
* :class:`~idemq.observe.prometheus.PrometheusObserver` and
  :class:`~idemq.observe.prometheus.StoreCollector` (extra ``metrics``);
* :class:`~idemq.observe.otel.OtelObserver` (``opentelemetry-api``, a no-op without it).

:class:`CompositeObserver` combines several. What the guard reports, stage by stage, is
described in :mod:`idemq.guard.probes`.
"""

from __future__ import annotations

from idemq.guard.probes import CompositeObserver, Observer, Probe, TimingProbe
from idemq.observe.labels import error_kind, outcome_label
from idemq.observe.logs import LoggingObserver

__all__ = [
    "CompositeObserver",
    "LoggingObserver",
    "Observer",
    "Probe",
    "TimingProbe",
    "error_kind",
    "outcome_label",
]
