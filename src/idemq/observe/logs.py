"""One structured log record per message, for operators who grep."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

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
