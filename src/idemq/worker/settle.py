"""Settles judged deliveries once each, after the effect committed, and counts them.

Both consume loops (one message at a time, :mod:`idemq.worker.loop`, and batched,
:mod:`idemq.worker.batch`) hand what they judged to one :class:`Settler`, so "ack once, after
commit" and the dead-letter bookkeeping live in one place.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from idemq.brokers.base import Delivery, settle_all
from idemq.brokers.settlement import DeadLetter, RetryPolicy, Settlement, Verdict, decide
from idemq.guard.probes import Observer
from idemq.observe.logs import redact_detail

__all__ = ["Settler", "WorkerStats"]

log = logging.getLogger("idemq.worker")


@dataclass
class WorkerStats:
    """What a worker run did, by verdict (a delivery counts once per delivery)."""

    verdicts: Counter[Verdict] = field(default_factory=Counter)
    settle_failures: int = 0

    @property
    def deliveries(self) -> int:
        """Deliveries handled, duplicates and retries included."""
        return sum(self.verdicts.values())

    def summary(self) -> dict[str, int]:
        """Counts by verdict name, e.g. ``{"processed": 10, "duplicate": 2}``."""
        out = {verdict.value: count for verdict, count in self.verdicts.items()}
        if self.settle_failures:
            out["settle_failures"] = self.settle_failures
        return out

    def __str__(self) -> str:
        return ", ".join(f"{name}={count}" for name, count in self.summary().items()) or "idle"


class Settler:
    """Settles judged deliveries as :func:`~idemq.brokers.settlement.decide` says, and counts.

    A delivery reaches the settler only once its guard call returned, so an ack always follows
    the commit of its effect. Dead letters are logged and told to the observer; a settlement the
    broker refused is logged and counted (the broker still holds the message and redelivers it,
    and the guard answers that redelivery DUPLICATE).
    """

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        consumer: str,
        observer: Observer | None = None,
        log_error_text: bool = False,
    ) -> None:
        self.policy = policy
        self.consumer = consumer
        # Exception texts in the worker's log lines (see idemq.observe.logs.error_summary).
        self.log_error_text = log_error_text
        self.observer = observer  # told about dead letters (the guard reports the rest)
        self.stats = WorkerStats()
        self._lock = threading.Lock()

    def settle_many(self, judged: Sequence[tuple[Delivery, Verdict, str]]) -> list[Verdict]:
        """Settle each ``(delivery, verdict, detail)`` in one go (the adapter may group them:
        one ``XACK`` for a batch); count them and return the verdicts."""
        pairs = [
            (delivery, self._decide(delivery, verdict, detail))
            for delivery, verdict, detail in judged
        ]
        for (delivery, settlement), future in zip(pairs, settle_all(pairs), strict=True):
            future.add_done_callback(functools.partial(self._settled, delivery, settlement))
        verdicts = [verdict for _, verdict, _ in judged]
        with self._lock:
            self.stats.verdicts.update(verdicts)
        return verdicts

    def _decide(self, delivery: Delivery, verdict: Verdict, detail: str) -> Settlement:
        settlement = decide(verdict, delivery.delivery_attempt, self.policy, detail)
        if isinstance(settlement, DeadLetter):
            # The dead letter carries the whole reason; the log line its class only, unless
            # told otherwise (the text may quote the payload).
            logged = detail if self.log_error_text else redact_detail(detail)
            reason = decide(verdict, delivery.delivery_attempt, self.policy, logged)
            assert isinstance(reason, DeadLetter)  # the same verdict, the same decision
            log.warning("dead-lettering %s: %s", delivery.describe(), reason.reason)
            if self.observer is not None:
                message_id = delivery.message.id if delivery.message is not None else "?"
                self.observer.dead_lettered(self.consumer, message_id, settlement.reason)
        return settlement

    def _settled(self, delivery: Delivery, settlement: Settlement, future: Future[None]) -> None:
        """Done-callback of a settlement (maybe on the broker client's thread)."""
        error = future.exception()
        if error is None:
            return
        log.error("settling %s as %s failed", delivery.describe(), settlement, exc_info=error)
        with self._lock:
            self.stats.settle_failures += 1
