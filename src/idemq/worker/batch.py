"""``idemq worker --batch-size N --batch-wait-ms T``: many deliveries per dedup transaction.

One transaction per message caps a PostgreSQL-backed consumer at a few thousand messages a
second (every commit waits for a WAL flush); ``guard.process_batch`` claims N messages in one
round trip and commits their effects together. This module feeds it from a broker::

    broker ─ N deliveries (or T ms, or idle) ─► guard.process_batch ─ COMMIT ─► decide() ─► settle

* A delivery is settled only **after** its batch committed, and by its **own** outcome, the
  whole batch in one call (``Settler.settle_many``: one ``XACK``, or one hop to an async
  client's loop for all its acks):
  PROCESSED/DUPLICATE → ack, IN_PROGRESS → retry later, FAILED → ``classify(outcome.error)``
  (a poison message is retried, then dead-lettered, while the rest of its batch is acked).
* If the batch itself fails (store down, commit refused), nothing of it committed: every
  delivery is settled by that one error (a store outage → retry, never dead-letter).
* At most ``N * concurrency`` deliveries are held: the broker is asked for the next one only
  when a slot is free, so nothing sits unacked without a thread to run it.
* ``T`` bounds how long a partial batch waits while messages keep coming; when the broker goes
  idle (the adapter yields ``None``, ≤ ~0.2 s) the partial batch is flushed at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from idemq.brokers.base import Delivery
from idemq.brokers.settlement import Verdict, classify
from idemq.errors import ConfigurationError
from idemq.guard.core import Status
from idemq.message import Message
from idemq.observe.logs import error_summary, redact_detail
from idemq.worker.executors import executor
from idemq.worker.settle import Settler

__all__ = ["BatchGuard", "BatchSettings", "BatchWorkerLoop", "collect", "verdict_of"]

log = logging.getLogger("idemq.worker")


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """How deliveries are grouped: up to ``size`` messages, a partial batch waits ``wait_ms``."""

    size: int
    wait_ms: int = 50

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigurationError(f"batch size must be >= 1, got {self.size}")
        if self.wait_ms < 0:
            raise ConfigurationError(f"batch wait must be >= 0 ms, got {self.wait_ms}")


class _Outcome(Protocol):
    @property
    def status(self) -> Status: ...

    @property
    def error(self) -> BaseException | None: ...


class BatchGuard(Protocol):
    """What the batching worker needs from :class:`idemq.Idempotency`."""

    def process_batch(
        self, messages: Sequence[Message], handler: Callable[[Message, Any], Any]
    ) -> Sequence[_Outcome]: ...


def verdict_of(outcome: _Outcome) -> tuple[Verdict, str]:
    """The settlement input of one batch outcome: FAILED is classified by its error."""
    if outcome.status is Status.FAILED:
        error = outcome.error
        assert error is not None, "a FAILED outcome carries its error"
        return classify(error), f"{type(error).__name__}: {error}"
    return Verdict[outcome.status.name], ""


def collect(
    deliveries: Iterator[Delivery | None],
    settings: BatchSettings,
    clock_ms: Callable[[], int] = lambda: time.monotonic_ns() // 1_000_000,
) -> Iterator[list[Delivery]]:
    """Group ``deliveries`` into batches: full, ``wait_ms`` after the first one, or on idle.

    An idle ``None`` from the broker flushes a partial batch: waiting longer would only add
    latency, since nothing else is arriving. What is held when the stream ends is flushed too,
    so a graceful stop still handles and settles every delivery it pulled.
    """
    pending: list[Delivery] = []
    deadline_ms = 0
    for delivery in deliveries:
        if delivery is not None:
            if not pending:
                deadline_ms = clock_ms() + settings.wait_ms
            pending.append(delivery)
        if pending and (
            delivery is None or len(pending) >= settings.size or clock_ms() >= deadline_ms
        ):
            yield pending
            pending = []
    if pending:
        yield pending


class BatchWorkerLoop:
    """The batched consume loop of a :class:`~idemq.worker.loop.Worker` (its ``batch`` setting).

    It gets what it needs handed in — the guard, the handler, the :class:`Settler` and how many
    threads — so it knows nothing of the worker that runs it.
    """

    def __init__(
        self,
        guard: object,
        handler: Callable[[Message, Any], Any],
        settler: Settler,
        settings: BatchSettings,
        *,
        concurrency: int = 1,
        before_each: Callable[[], object] | None = None,
    ) -> None:
        if not callable(getattr(guard, "process_batch", None)):
            raise ConfigurationError(f"{type(guard).__name__} has no process_batch()")
        self.guard: BatchGuard = guard  # type: ignore[assignment]
        self.handler = handler
        self.settler = settler
        self.settings = settings
        self.concurrency = concurrency
        self.before_each = before_each

    @property
    def slots(self) -> int:
        """Deliveries held at most: a full batch per thread."""
        return self.settings.size * self.concurrency

    def run(self, deliveries: Iterator[Delivery | None], slots: threading.Semaphore) -> None:
        """Consume until the stream ends; every batch handed out is settled before returning."""
        # One batch per thread; a thread gives its slots back once its batch is settled.
        with executor(self.concurrency, "idemq-batch") as pool:
            for batch in collect(deliveries, self.settings):
                pool.submit(self._handle_in_slots, batch, slots)

    def handle(self, batch: Sequence[Delivery]) -> list[Verdict]:
        """Run ``batch`` through ``guard.process_batch``, then settle its deliveries together."""
        results = [(Verdict.INVALID_MESSAGE, d.decode_error or "undecodable") for d in batch]
        decoded = [(i, d.message) for i, d in enumerate(batch) if d.message is not None]
        if decoded:
            outcomes = self._judge([message for _, message in decoded])
            for (i, _), result in zip(decoded, outcomes, strict=True):
                results[i] = result
        judged = []
        for delivery, (verdict, detail) in zip(batch, results, strict=True):
            if verdict is Verdict.HANDLER_ERROR:
                log.warning(
                    "handler failed on %s (attempt %d): %s",
                    delivery.describe(),
                    delivery.delivery_attempt,
                    detail if self.settler.log_error_text else redact_detail(detail),
                )
            judged.append((delivery, verdict, detail))
        return self.settler.settle_many(judged)

    def _judge(self, messages: list[Message]) -> list[tuple[Verdict, str]]:
        try:
            if self.before_each is not None:  # see Worker: outside the batch's transaction
                self.before_each()
            # The guard itself reruns a batch that hit a deadlock (nothing of it committed).
            outcomes = self.guard.process_batch(messages, self.handler)
        except Exception as exc:
            # Nothing of the batch committed: each delivery is settled by this one error.
            if self.settler.log_error_text:
                log.warning("batch of %d failed", len(messages), exc_info=True)
            else:  # its text may quote a payload: not logged (see error_summary)
                log.warning("batch of %d failed: %s", len(messages), error_summary(exc))
            return [(classify(exc), f"{type(exc).__name__}: {exc}")] * len(messages)
        return [verdict_of(outcome) for outcome in outcomes]

    def _handle_in_slots(self, batch: list[Delivery], slots: threading.Semaphore) -> None:
        try:
            self.handle(batch)
        except Exception:
            log.exception("unexpected failure handling a batch of %d", len(batch))
        finally:
            for _ in batch:
                slots.release()
