"""Observer hooks: the stage sequence, structured logs without payloads, composite, OTel spans.

No SDK is installed, so the span tests use a tiny recording TracerProvider written against the
opentelemetry-api interfaces (the API is what idemq depends on).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

import idemq
from idemq.guard.probes import CompositeObserver, Observer
from idemq.observe.logs import LoggingObserver
from idemq.observe.otel import OtelObserver, tracing_available
from idemq.stores import store_label


class Recorder(Observer):
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def claim_done(self, consumer: str, message_id: str, seconds: float, status: Any) -> None:
        assert seconds >= 0
        self.events.append(("claim", message_id, None if status is None else status.value))

    def handler_done(self, consumer: str, message_id: str, seconds: float, error: Any) -> None:
        self.events.append(("handler", message_id, type(error).__name__ if error else None))

    def finished(
        self, consumer: str, message_id: str, seconds: float, outcome: Any, error: Any
    ) -> None:
        label = outcome.status.value if outcome else type(error).__name__
        self.events.append(("finished", message_id, label))

    def dead_lettered(self, consumer: str, message_id: str, reason: str) -> None:
        self.events.append(("dead", message_id, reason))


def test_stages_in_order_lease_mode() -> None:
    recorder = Recorder()
    guard = idemq.Idempotency(idemq.MemoryStore(), consumer="c", observer=recorder)
    guard.process("A", lambda _tx: 1)
    guard.process("A", lambda _tx: 1)
    with pytest.raises(KeyError):
        guard.process("B", lambda _tx: {}["missing"])
    with pytest.raises(idemq.InvalidMessageIdError):
        guard.process("", lambda _tx: 1)
    assert recorder.events == [
        ("claim", "A", None),
        ("handler", "A", None),
        ("finished", "A", "processed"),
        ("claim", "A", "duplicate"),
        ("finished", "A", "duplicate"),
        ("claim", "B", None),
        ("handler", "B", "KeyError"),
        ("finished", "B", "KeyError"),
        ("finished", "", "InvalidMessageIdError"),  # nothing was claimed
    ]


def test_no_observer_means_no_probe() -> None:
    guard = idemq.Idempotency(idemq.MemoryStore(), consumer="c")
    assert guard.observer is None
    assert guard.process("A", lambda _tx: 1).status is idemq.Status.PROCESSED


def test_logging_observer_fields_and_no_payload(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="idemq.guard")
    guard = idemq.Idempotency(idemq.MemoryStore(), consumer="orders", observer=LoggingObserver())
    guard.process("M1", lambda _tx: {"card": "4111-secret"}, payload={"card": "4111-secret"})
    guard.process("M1", lambda _tx: None, payload={"card": "4111-secret"})

    def fail(_tx: Any) -> None:
        raise ValueError("card 4111-secret declined")

    with pytest.raises(ValueError, match="declined"):
        guard.process("M2", fail)
    records = [r for r in caplog.records if r.name == "idemq.guard"]
    fields = [(r.idemq_message_id, r.idemq_outcome, r.idemq_consumer) for r in records]  # type: ignore[attr-defined]
    assert fields == [
        ("M1", "processed", "orders"),
        ("M1", "duplicate", "orders"),
        ("M2", "error", "orders"),
    ]
    assert [r.levelno for r in records] == [logging.DEBUG, logging.INFO, logging.WARNING]
    assert records[2].idemq_error == "ValueError"  # type: ignore[attr-defined]
    assert "4111-secret" not in caplog.text
    assert all("4111-secret" not in repr(r.__dict__) for r in records)


def test_logging_observer_can_include_error_text(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="idemq.guard")
    observer = LoggingObserver(include_error_text=True)
    guard = idemq.Idempotency(idemq.MemoryStore(), consumer="c", observer=observer)
    with pytest.raises(RuntimeError):
        guard.process("M", lambda _tx: (_ for _ in ()).throw(RuntimeError("why it failed")))
    assert "why it failed" in caplog.text


def test_composite_fans_out_every_stage_and_dead_letters() -> None:
    first, second = Recorder(), Recorder()
    composite = CompositeObserver(first, second)
    guard = idemq.Idempotency(idemq.MemoryStore(), consumer="c", observer=composite)
    guard.process("A", lambda _tx: 1)
    composite.dead_lettered("c", "Z", "too many attempts")
    assert first.events == second.events
    assert first.events[-1] == ("dead", "Z", "too many attempts")
    assert len(first.events) == 4


def test_batch_reports_each_outcome() -> None:
    recorder = Recorder()
    guard = idemq.Idempotency(idemq.MemoryStore(), consumer="c", observer=recorder)
    messages = [idemq.Message(id=i, body=b"") for i in ("A", "B", "A")]
    guard.process_batch(messages, lambda _msg, _tx: None)
    assert recorder.events == [
        ("finished", "A", "processed"),
        ("finished", "B", "processed"),
        ("finished", "A", "duplicate"),
    ]


def test_store_label_has_no_credentials(tmp_path: Any) -> None:
    assert store_label(idemq.MemoryStore()) == "memory"
    store = idemq.SqlStore(f"sqlite:///{tmp_path / 'x.db'}", table="orders_dedup")
    assert store_label(store) == "sqlite/orders_dedup"
    store.close()


# -- tracing -----------------------------------------------------------------------------------

_ids = itertools.count(1)


class RecordedSpan(NonRecordingSpan):
    def __init__(self, name: str, parent: Any, log: list[RecordedSpan]) -> None:
        super().__init__(SpanContext(1, next(_ids), False, TraceFlags(TraceFlags.SAMPLED)))
        self.name = name
        self.parent = parent
        self.attributes: dict[str, Any] = {}
        self.status: Any = None
        self.ended = False
        log.append(self)

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_status(self, status: Any, description: str | None = None) -> None:
        self.status = status

    def end(self, end_time: int | None = None) -> None:
        self.ended = True


class RecordingTracer(trace.Tracer):
    def __init__(self) -> None:
        self.spans: list[RecordedSpan] = []

    def start_span(self, name: str, context: Any = None, *args: Any, **kwargs: Any) -> Any:
        parent = trace.get_current_span(context)
        span = RecordedSpan(name, parent if isinstance(parent, RecordedSpan) else None, self.spans)
        for key, value in (kwargs.get("attributes") or {}).items():
            span.set_attribute(key, value)
        return span

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


class RecordingProvider(trace.TracerProvider):
    def __init__(self) -> None:
        self.tracer = RecordingTracer()

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return self.tracer


def test_spans_around_claim_handler_and_complete() -> None:
    assert tracing_available()
    provider = RecordingProvider()
    guard = idemq.Idempotency(idemq.MemoryStore(), consumer="c", observer=OtelObserver(provider))
    inner: list[Any] = []
    guard.process("A", lambda _tx: inner.append(trace.get_current_span()), payload=b"secret")
    spans = provider.tracer.spans
    assert [s.name for s in spans] == [
        "idemq.process",
        "idemq.claim",
        "idemq.handler",
        "idemq.complete",
    ]
    root = spans[0]
    assert all(s.ended for s in spans)
    assert all(s.parent is root for s in spans[1:])
    assert inner == [spans[2]]  # the handler's span is current while it runs
    assert root.attributes["idemq.outcome"] == "processed"
    assert root.attributes["messaging.message.id"] == "A"
    assert spans[1].attributes["idemq.claim.status"] == "won"
    assert trace.get_current_span() is trace.INVALID_SPAN  # detached afterwards
    assert "secret" not in repr([s.attributes for s in spans])


def test_spans_of_a_failure_and_a_duplicate() -> None:
    provider = RecordingProvider()
    guard = idemq.Idempotency(idemq.MemoryStore(), consumer="c", observer=OtelObserver(provider))
    with pytest.raises(ZeroDivisionError):
        guard.process("B", lambda _tx: 1 / 0)
    names = [s.name for s in provider.tracer.spans]
    assert names == ["idemq.process", "idemq.claim", "idemq.handler"]
    root, _claim, handler = provider.tracer.spans
    assert handler.status.status_code is trace.StatusCode.ERROR
    assert root.attributes["idemq.outcome"] == "error"
    assert root.attributes["error.type"] == "ZeroDivisionError"
    provider.tracer.spans.clear()
    guard.process("C", lambda _tx: 1)
    provider.tracer.spans.clear()
    guard.process("C", lambda _tx: 1)
    assert [s.name for s in provider.tracer.spans] == ["idemq.process", "idemq.claim"]
    assert provider.tracer.spans[1].attributes["idemq.claim.status"] == "duplicate"
    assert all(s.ended for s in provider.tracer.spans)
