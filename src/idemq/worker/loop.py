"""``idemq worker``: run a handler behind the guard on any broker, settling every delivery right.

The loop is synchronous with a thread pool (``concurrency`` threads): async broker clients run
their own event loop in a background thread inside the adapter, so every adapter looks the same.

Lifecycle of one delivery::

    broker ──Delivery──► guard.process(msg.id, handler) ──Outcome/exception──► decide() ──► settle

A slot of the pool is taken *before* the next delivery is pulled, so the worker never holds a
message it has no thread for (it would sit invisible until a timeout). With one thread (the
default) the handler runs in the consuming thread itself (:mod:`idemq.worker.executors`).

Settling does not wait for the broker where its client queues acks (RabbitMQ, NATS): a failed
ack is reported later through its future, logged and counted in ``stats.settle_failures``, and
``broker.close()`` sends what is still queued. SIGTERM/SIGINT stop the pulling, let in-flight
handlers finish and settle, then close the broker: nothing in flight is lost or acked early.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from idemq._outage import Outage
from idemq.brokers.base import Broker, Delivery
from idemq.brokers.settlement import RetryPolicy, Verdict, classify
from idemq.errors import BrokerError, ConfigurationError
from idemq.guard.probes import Observer
from idemq.message import Message
from idemq.observe.logs import error_summary
from idemq.worker.batch import BatchSettings, BatchWorkerLoop
from idemq.worker.executors import executor
from idemq.worker.settle import Settler, WorkerStats

__all__ = ["Guard", "Handler", "Worker"]

log = logging.getLogger("idemq.worker")

Handler = Callable[[Message, Any], Any]
"""A worker handler: ``handle(msg, tx)``; ``tx`` is the dedup transaction's connection or None."""


class _Outcome(Protocol):
    @property
    def status(self) -> Any: ...


class Guard(Protocol):
    """What the worker needs from :class:`idemq.Idempotency`."""

    def process(
        self,
        message_id: str,
        handler: Callable[[Any], Any],
        *,
        business_id: str | None = None,
        payload: object = None,
    ) -> _Outcome: ...


class Worker:
    """Pulls deliveries from one queue; runs each through the guard on ``concurrency`` threads."""

    def __init__(
        self,
        handler: Handler,
        broker: Broker,
        guard: Guard,
        queue: str,
        *,
        concurrency: int = 1,
        prefetch: int | None = None,
        policy: RetryPolicy | None = None,
        description: str = "",
        observer: Observer | None = None,
        batch: BatchSettings | None = None,
        give_up_after_s: float | None = None,
        startup_give_up_after_s: float | None = None,
        log_error_text: bool = False,
    ) -> None:
        if concurrency < 1:
            raise ConfigurationError(f"concurrency must be >= 1, got {concurrency}")
        self.handler = handler
        self.broker = broker
        self.guard = guard
        self.queue = queue
        self.concurrency = concurrency
        self.policy = policy or RetryPolicy()
        self.settler = Settler(
            self.policy,
            consumer=getattr(guard, "consumer", queue),
            observer=observer,
            log_error_text=log_error_text,
        )
        # Batched (worker.batch): a full batch per thread in flight, and as many again
        # prefetched, so the broker refills while a batch commits instead of after its acks.
        self.batch = (
            None
            if batch is None
            else BatchWorkerLoop(guard, handler, self.settler, batch, concurrency=concurrency)
        )
        in_flight = concurrency if self.batch is None else 2 * self.batch.slots
        self.prefetch = prefetch if prefetch is not None else in_flight
        self.description = description or f"queue={queue}"
        self.stopping = threading.Event()
        # Outages are ridden out with one log line per attempt: until the broker first answers
        # for startup_give_up_after_s, then for give_up_after_s (None: forever).
        self.give_up_after_s = give_up_after_s
        self.outage = Outage(startup_give_up_after_s, self.stopping)

    @property
    def stats(self) -> WorkerStats:
        """What this worker settled so far, by verdict."""
        return self.settler.stats

    def stop(self) -> None:
        """Ask the loop to stop pulling; in-flight deliveries still finish and settle."""
        self.stopping.set()

    def run(self) -> WorkerStats:
        """Consume until :meth:`stop`; return what was done. Closes the broker on the way out."""
        if self.batch is not None:
            batch_slots = threading.Semaphore(self.batch.slots)
            try:
                self.batch.run(self._deliveries(batch_slots), batch_slots)
            finally:
                self.broker.close()
            log.info("idemq worker stopped: %s", self.stats)
            return self.stats
        slots = threading.Semaphore(self.concurrency)
        try:
            with executor(self.concurrency, "idemq-worker") as pool:
                for delivery in self._deliveries(slots):
                    if delivery is None:
                        continue
                    pool.submit(self._handle_in_slot, delivery, slots)
                # leaving the with-block waits for in-flight handlers: they finish and settle
        finally:
            self.broker.close()
        log.info("idemq worker stopped: %s", self.stats)
        return self.stats

    def handle(self, delivery: Delivery) -> Verdict:
        """Run one delivery through the guard and settle it as :func:`decide` says."""
        verdict, detail = self._verdict(delivery)
        return self.settle(delivery, verdict, detail)

    def settle(self, delivery: Delivery, verdict: Verdict, detail: str = "") -> Verdict:
        """Settle ``delivery`` as :func:`decide` says for ``verdict``; count it."""
        return self.settler.settle_many([(delivery, verdict, detail)])[0]

    # -- internals ---------------------------------------------------------------------------

    def _verdict(self, delivery: Delivery) -> tuple[Verdict, str]:
        message = delivery.message
        if message is None:
            return Verdict.INVALID_MESSAGE, delivery.decode_error or "undecodable"
        handler = self.handler
        try:
            outcome = self.guard.process(
                message.id,
                lambda tx: handler(message, tx),
                business_id=message.business_id,
                payload=message.body,
            )
        except Exception as exc:
            verdict = classify(exc)
            if verdict is Verdict.HANDLER_ERROR and self.settler.log_error_text:
                log.warning(
                    "handler failed on %s (attempt %d)",
                    delivery.describe(),
                    delivery.delivery_attempt,
                    exc_info=True,
                )
            elif verdict is Verdict.HANDLER_ERROR:  # its text may quote the payload: not logged
                log.warning(
                    "handler failed on %s (attempt %d): %s",
                    delivery.describe(),
                    delivery.delivery_attempt,
                    error_summary(exc),
                )
            return verdict, f"{type(exc).__name__}: {exc}"
        return Verdict[outcome.status.name], ""

    def _handle_in_slot(self, delivery: Delivery, slots: threading.Semaphore) -> None:
        try:
            self.handle(delivery)
        except Exception:
            log.exception("unexpected failure handling %s", delivery.describe())
        finally:
            slots.release()

    def _deliveries(self, slots: threading.Semaphore) -> Iterator[Delivery | None]:
        """Deliveries, each pulled only once a slot is free; reconnects after broker failures."""
        ready = False
        while not self.stopping.is_set():
            self.outage.attempting()
            stream = self.broker.consume(self.queue, prefetch=self.prefetch)
            try:
                while not self.stopping.is_set():
                    if not slots.acquire(timeout=0.2):
                        yield None
                        continue
                    try:
                        delivery = next(stream)
                    except BaseException:
                        slots.release()
                        raise
                    if not ready:  # the broker answered: batched or not, say so once
                        ready = True
                        self.outage.give_up_after_s = self.give_up_after_s
                        log.info("idemq worker ready: %s", self.description)
                    if delivery is None:
                        slots.release()
                    yield delivery
                    self.outage.over()
                return
            except StopIteration:
                return
            except BrokerError as exc:
                self.outage.failed(exc, f"consuming {self.queue}")
            finally:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
