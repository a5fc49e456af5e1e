"""OpenTelemetry spans around the guard's stages — a no-op when ``opentelemetry-api`` is absent.

One message gives this tree (span kind INTERNAL; attributes never include the payload)::

    idemq.process      messaging.message.id, idemq.consumer, idemq.outcome
    ├── idemq.claim    idemq.claim.status = won | duplicate | in_progress
    ├── idemq.handler  current while the handler runs, so your DB/HTTP spans nest under it
    └── idemq.complete confirm_in + COMMIT (transactional) or complete (lease)

An error sets the span status to ERROR with the exception's *class name* only: its text may
quote the payload or a statement's parameters. Without an SDK configured, opentelemetry-api
hands out non-recording spans, so the observer costs little until tracing is switched on.
"""

from __future__ import annotations

from typing import Any

from idemq.guard.core import Outcome, Status
from idemq.guard.probes import Observer, Probe
from idemq.observe.labels import outcome_label

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
except ImportError:  # pragma: no cover - exercised only without the extra
    trace = None  # type: ignore[assignment]
    otel_context = None  # type: ignore[assignment]

__all__ = ["TRACER_NAME", "OtelObserver", "tracing_available"]

TRACER_NAME = "idemq"


def tracing_available() -> bool:
    """True when ``opentelemetry-api`` is installed (spans are then created)."""
    return trace is not None


class _NullProbe:
    __slots__ = ()

    def claimed(self, status: Status | None) -> None:
        pass

    def handler_started(self) -> None:
        pass

    def handler_done(self, error: BaseException | None) -> None:
        pass

    def finished(self, outcome: Outcome[Any] | None, error: BaseException | None) -> None:
        pass


_NULL_PROBE = _NullProbe()


def _fail(span: Any, error: BaseException) -> None:
    span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
    span.set_attribute("error.type", type(error).__name__)


class _SpanProbe:
    """The spans of one message; the handler's span is made current while the handler runs."""

    __slots__ = ("_current", "_root", "_token", "_tracer")

    def __init__(self, tracer: Any, consumer: str, message_id: str) -> None:
        self._tracer = tracer
        self._root = tracer.start_span(
            "idemq.process",
            attributes={"messaging.message.id": message_id, "idemq.consumer": consumer},
        )
        self._current = self._child("idemq.claim")
        self._token: object | None = None

    def _child(self, name: str) -> Any:
        return self._tracer.start_span(name, context=trace.set_span_in_context(self._root))

    def claimed(self, status: Status | None) -> None:
        self._current.set_attribute("idemq.claim.status", "won" if status is None else status.value)
        self._current.end()
        self._current = None

    def handler_started(self) -> None:
        self._current = self._child("idemq.handler")
        self._token = otel_context.attach(trace.set_span_in_context(self._current))

    def handler_done(self, error: BaseException | None) -> None:
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            self._token = None
        if error is not None:
            _fail(self._current, error)
        self._current.end()
        # What follows a successful handler is the completion (confirm_in + COMMIT / complete).
        self._current = None if error is not None else self._child("idemq.complete")

    def finished(self, outcome: Outcome[Any] | None, error: BaseException | None) -> None:
        if self._current is not None:  # the claim (it raised) or the completion
            if error is not None:
                _fail(self._current, error)
            self._current.end()
            self._current = None
        self._root.set_attribute("idemq.outcome", outcome_label(outcome, error))
        if error is not None:
            _fail(self._root, error)
        self._root.end()


class OtelObserver(Observer):
    """Spans around claim, handler and complete (see the module doc); pass as ``observer=``.

    ``tracer_provider``: default the global one (``opentelemetry.trace.get_tracer_provider()``).
    Without ``opentelemetry-api`` installed every method is a no-op.
    """

    def __init__(self, tracer_provider: Any = None) -> None:
        self.tracer: Any = None
        if trace is not None:
            self.tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)

    def begin(self, consumer: str, message_id: str) -> Probe:
        """Open the message's root span and its claim span."""
        if self.tracer is None:
            return _NULL_PROBE
        return _SpanProbe(self.tracer, consumer, message_id)
