"""The two log formats of the ``idemq`` commands: one line per record, tracebacks only for the
unexpected (or with ``tracebacks=True``), JSON with the per-message fields."""

from __future__ import annotations

import json
import logging
import sys

from idemq.errors import StoreUnavailableError
from idemq.observe.logs import JsonFormatter, LoggingObserver, TextFormatter


def record(message: str, error: BaseException | None = None, **extra: object) -> logging.LogRecord:
    exc_info = None
    if error is not None:
        try:
            raise error
        except BaseException:
            exc_info = sys.exc_info()
    made = logging.LogRecord("idemq.worker", logging.WARNING, __file__, 1, message, (), exc_info)
    made.__dict__.update(extra)
    return made


def test_an_idemq_error_is_one_line_without_traceback():
    error = StoreUnavailableError("connection refused\n(Background on this error at: x)")
    line = TextFormatter().format(record("broker failed", error))
    assert "\n" not in line
    assert line.endswith(
        "WARNING idemq.worker broker failed: StoreUnavailableError: connection refused"
        " \\n (Background on this error at: x)"
    )


def test_an_unexpected_error_keeps_its_traceback():
    text = TextFormatter().format(record("unexpected failure", KeyError("k")))
    first, rest = text.split("\n", 1)
    assert first.endswith("unexpected failure: KeyError: 'k'")
    assert rest.startswith("Traceback (most recent call last):")


def test_tracebacks_true_writes_them_for_idemq_errors_too():
    text = TextFormatter(tracebacks=True).format(record("x", StoreUnavailableError("down")))
    assert "Traceback (most recent call last):" in text
    data = json.loads(JsonFormatter(tracebacks=True).format(record("x", StoreUnavailableError())))
    assert data["traceback"].startswith("Traceback")


def test_json_has_the_message_fields_from_the_logging_observer():
    captured: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            captured.append(record)

    logger = logging.getLogger("test_log_formats")
    logger.addHandler(Keep())
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    LoggingObserver(logger).finished("payments", "ORDER_1", 0.0125, None, ValueError("x"))
    data = json.loads(JsonFormatter().format(captured[0]))
    assert data["message_id"] == "ORDER_1"
    assert data["consumer"] == "payments"
    assert data["outcome"] == "error"
    assert data["duration_ms"] == 12.5
    assert data["error_class"] == "ValueError"
    assert data["level"] == "WARNING"
    assert "traceback" not in data


def test_json_of_a_plain_record_has_null_fields_and_the_error_class():
    data = json.loads(JsonFormatter().format(record("relay waiting", StoreUnavailableError("d"))))
    assert data["message"] == "relay waiting: StoreUnavailableError: d"
    assert data["error_class"] == "StoreUnavailableError"
    assert data["message_id"] is None
    assert data["outcome"] is None
    assert "traceback" not in data
