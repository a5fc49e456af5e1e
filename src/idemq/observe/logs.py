"""One structured log record per message, for operators who grep, and the two formats the
``idemq`` commands write them in (``--log-format text|json``).

Both formats write one record per line, whatever the terminal width: an operator's
``grep MSG_ID worker.log`` finds the whole record. An expected failure (an idemq error: the store
or the broker is down, a bad configuration) is logged as its class and message on the same line;
a traceback is written only for an unexpected exception, or for every one with ``tracebacks=True``
(``idemq -v``).

What a worker logs about a *failing handler* is :func:`error_summary`: by default the
exception's class and where it was raised, never its text nor a traceback (a handler's error
often quotes the payload it choked on: a card number, an address, a token). The text and the
traceback are an opt-in (``idemq worker --log-error-text``); the dead letter itself always keeps
the full reason in its headers, where the payload already is.
"""

from __future__ import annotations

import json
import logging
import re
import traceback
from datetime import UTC, datetime
from pathlib import PurePath
from typing import Any, ClassVar

from idemq.errors import IdemqError
from idemq.guard.core import Outcome
from idemq.guard.probes import Observer
from idemq.observe.labels import outcome_label


class LoggingObserver(Observer):
    """One structured log record per message through ``logger`` (default ``idemq.guard``).

    Fields (``extra=``): ``idemq_message_id``, ``idemq_outcome``, ``idemq_consumer``,
    ``idemq_duration_ms``, and ``idemq_error`` (the exception's class name) on errors.
    Levels: processed → DEBUG, duplicate / in_progress → INFO (what an on-call engineer looks
    for), errors → WARNING, dead letters → ERROR. Payloads and results are never logged; an
    exception's text only with ``include_error_text=True`` (a handler's error may quote the
    payload, a driver's the statement's parameters).
    """

    LEVELS: ClassVar[dict[str, int]] = {
        "processed": logging.DEBUG,
        "duplicate": logging.INFO,
        "in_progress": logging.INFO,
    }

    def __init__(
        self, logger: logging.Logger | None = None, *, include_error_text: bool = False
    ) -> None:
        self.logger = logger or logging.getLogger("idemq.guard")
        self.include_error_text = include_error_text

    def finished(
        self,
        consumer: str,
        message_id: str,
        seconds: float,
        outcome: Outcome[Any] | None,
        error: BaseException | None,
    ) -> None:
        """Log the outcome (or the error's kind and class) with the structured fields."""
        label = outcome_label(outcome, error)
        level = self.LEVELS.get(label, logging.WARNING)
        if not self.logger.isEnabledFor(level):
            return
        extra: dict[str, Any] = {
            "idemq_message_id": message_id,
            "idemq_outcome": label,
            "idemq_consumer": consumer,
            "idemq_duration_ms": round(seconds * 1000, 3),
        }
        failure = error if error is not None else (outcome.error if outcome else None)
        if failure is None:
            self.logger.log(level, "idemq %s %s (%s)", label, message_id, consumer, extra=extra)
            return
        extra["idemq_error"] = type(failure).__name__
        detail = f": {failure}" if self.include_error_text else ""
        self.logger.log(
            level,
            "idemq %s %s (%s): %s%s",
            label,
            message_id,
            consumer,
            type(failure).__name__,
            detail,
            extra=extra,
        )

    def dead_lettered(self, consumer: str, message_id: str, reason: str) -> None:
        """Log the dead letter at ERROR (the reason names the verdict, not the payload)."""
        self.logger.error(
            "idemq dead_lettered %s (%s)",
            message_id,
            consumer,
            extra={
                "idemq_message_id": message_id,
                "idemq_outcome": "dead_lettered",
                "idemq_consumer": consumer,
            },
        )


def error_summary(error: BaseException, *, text: bool = False) -> str:
    """How a log line names ``error``: ``ValueError raised at shop.py:12 in handle`` (the
    innermost frame of its traceback), or with ``text`` ``ValueError: its text``."""
    name = type(error).__name__
    if text:
        return f"{name}: {error}"
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return name
    where = frames[-1]
    return f"{name} raised at {PurePath(where.filename).name}:{where.lineno} in {where.name}"


_ERROR_DETAIL = re.compile(r"(?P<name>[A-Za-z_][\w.]*): ", re.DOTALL)


def redact_detail(detail: str) -> str:
    """A failure's ``"ErrorClass: its text"`` (how a dead-letter reason carries it) as
    ``"ErrorClass"``, for a log line; a detail without a class in front is idemq's own words
    (``"undecodable"``) and stays as it is."""
    match = _ERROR_DETAIL.match(detail)
    return match.group("name") if match else detail


# The LoggingObserver's structured fields, under the names a JSON record gives them.
_FIELDS = {
    "idemq_message_id": "message_id",
    "idemq_consumer": "consumer",
    "idemq_outcome": "outcome",
    "idemq_duration_ms": "duration_ms",
    "idemq_error": "error_class",
}


def _one_line(text: str) -> str:
    # A driver's message may span lines (SQLAlchemy adds its "Background on this error" line);
    # a record that stays on one line is one grep match.
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", " \\n ")


def _timestamp(record: logging.LogRecord) -> str:
    moment = datetime.fromtimestamp(record.created, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _Formatter(logging.Formatter):
    """What both formats share: which exceptions get a traceback."""

    def __init__(self, *, tracebacks: bool = False) -> None:
        super().__init__()
        self.tracebacks = tracebacks

    def failure(self, record: logging.LogRecord) -> tuple[BaseException | None, str | None]:
        """The record's exception, and its traceback if it is to be written."""
        error = record.exc_info[1] if record.exc_info else None
        if error is None:
            return None, None
        if self.tracebacks or not isinstance(error, IdemqError):
            assert record.exc_info is not None  # error came from it
            return error, self.formatException(record.exc_info)
        return error, None


class TextFormatter(_Formatter):
    """``2026-01-15T14:30:00.123Z WARNING idemq.worker the message: ErrorClass: its text``.

    One line per record; an unexpected exception's traceback follows on the next lines.
    """

    def format(self, record: logging.LogRecord) -> str:
        """The record on one line (plus an unexpected exception's traceback)."""
        line = f"{_timestamp(record)} {record.levelname} {record.name} {record.getMessage()}"
        error, trace = self.failure(record)
        if error is not None:
            line += f": {type(error).__name__}: {error}"
        line = _one_line(line)
        return line if trace is None else f"{line}\n{trace}"


class JsonFormatter(_Formatter):
    """One JSON object per line: ``time``, ``level``, ``logger``, ``message``, and the
    per-message fields ``message_id``, ``consumer``, ``outcome``, ``duration_ms``,
    ``error_class`` (``null`` when a record has none); ``traceback`` for an unexpected
    exception.
    """

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        fields = vars(record)
        data: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        data.update({name: fields.get(extra) for extra, name in _FIELDS.items()})
        error, trace = self.failure(record)
        if error is not None:
            data["message"] += f": {type(error).__name__}: {error}"
            data["error_class"] = data["error_class"] or type(error).__name__
        if trace is not None:
            data["traceback"] = trace
        return json.dumps(data, default=str, ensure_ascii=False)
