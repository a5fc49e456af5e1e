"""``idemq worker``: run a handler behind the guard on any broker, settling every delivery right.

The loop is synchronous with a thread pool (``concurrency`` threads): async broker clients run
their own event loop in a background thread inside the adapter, so every adapter looks the same.

Lifecycle of one delivery::

    broker ──Delivery──► guard.process(msg.id, handler) ──Outcome/exception──► decide() ──► settle

A slot of the pool is taken *before* the next delivery is pulled, so the worker never holds a
message it has no thread for (it would sit invisible until a timeout). With one thread (the
default) the handler runs in the consuming thread itself (:mod:`idemq._executors`).

Settling does not wait for the broker where its client queues acks (RabbitMQ, NATS): a failed
ack is reported later through its future, logged and counted in ``stats.settle_failures``, and
``broker.close()`` sends what is still queued. SIGTERM/SIGINT stop the pulling, let in-flight
handlers finish and settle, then close the broker: nothing in flight is lost or acked early.
"""

from __future__ import annotations

import functools
import importlib
import logging
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

import idemq
from idemq._executors import executor
from idemq.batching import BatchSettings, BatchWorkerLoop
from idemq.brokers import open_broker
from idemq.brokers.base import (
    Broker,
    DeadLetter,
    Delivery,
    RetryPolicy,
    Settlement,
    Verdict,
    classify,
    decide,
    mask_url,
    settle_all,
)
from idemq.errors import BrokerError, ConfigurationError
from idemq.message import Message
from idemq.observe import Observer, worker_observer

__all__ = ["Guard", "Handler", "Worker", "WorkerStats", "load_handler", "open_guard", "run_worker"]

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


def open_guard(store_url: str, consumer: str) -> idemq.Idempotency:
    """An :class:`idemq.Idempotency` over the store at ``store_url`` (SQLAlchemy or redis URL).

    SQL stores run in transactional mode (schema created if missing); Redis in lease mode.
    """
    if store_url.startswith(("redis://", "rediss://", "unix://")):
        # Imported here: redis is an optional extra, needed only for a Redis store.
        from idemq.stores.redis import RedisStore  # noqa: PLC0415

        redis_store = RedisStore(store_url)
        return idemq.Idempotency(redis_store, consumer=consumer, mode="lease")
    sql_store = idemq.SqlStore(store_url)
    sql_store.create_schema()
    return idemq.Idempotency(sql_store, consumer=consumer)


def load_handler(spec: str) -> Handler:
    """Import ``"package.module:function"`` (attribute paths like ``mod:obj.method`` work too)."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ConfigurationError(f"handler must look like MODULE:HANDLER, got {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            target = getattr(target, attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot load handler {spec!r}: {exc}") from exc
    if not callable(target):
        raise ConfigurationError(f"handler {spec!r} is not callable")
    handler: Handler = target
    return handler


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
    ) -> None:
        if concurrency < 1:
            raise ConfigurationError(f"concurrency must be >= 1, got {concurrency}")
        self.handler = handler
        self.broker = broker
        self.guard = guard
        self.queue = queue
        self.concurrency = concurrency
        # Batched (idemq.batching): a full batch per thread in flight, and as many again
        # prefetched, so the broker refills while a batch commits instead of after its acks.
        self.batch = None if batch is None else BatchWorkerLoop(self, batch)
        in_flight = concurrency if self.batch is None else 2 * self.batch.slots
        self.prefetch = prefetch if prefetch is not None else in_flight
        self.policy = policy or RetryPolicy()
        self.description = description or f"queue={queue}"
        self.observer = observer  # told about dead letters (the guard reports the rest)
        self.stats = WorkerStats()
        self.stopping = threading.Event()
        self._stats_lock = threading.Lock()

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
        return self.settle_many([(delivery, verdict, detail)])[0]

    def settle_many(self, judged: Sequence[tuple[Delivery, Verdict, str]]) -> list[Verdict]:
        """Settle each ``(delivery, verdict, detail)`` as :func:`decide` says, all in one go
        (the adapter may group them: one ``XACK`` for a batch); count them."""
        pairs = [
            (delivery, self._decide(delivery, verdict, detail))
            for delivery, verdict, detail in judged
        ]
        for (delivery, settlement), future in zip(pairs, settle_all(pairs), strict=True):
            future.add_done_callback(functools.partial(self._settled, delivery, settlement))
        verdicts = [verdict for _, verdict, _ in judged]
        with self._stats_lock:
            self.stats.verdicts.update(verdicts)
        return verdicts

    # -- internals ---------------------------------------------------------------------------

    def _decide(self, delivery: Delivery, verdict: Verdict, detail: str) -> Settlement:
        settlement = decide(verdict, delivery.delivery_attempt, self.policy, detail)
        if isinstance(settlement, DeadLetter):
            log.warning("dead-lettering %s: %s", delivery.describe(), settlement.reason)
            if self.observer is not None:
                message_id = delivery.message.id if delivery.message is not None else "?"
                consumer = getattr(self.guard, "consumer", self.queue)
                self.observer.dead_lettered(consumer, message_id, settlement.reason)
        return settlement

    def _settled(self, delivery: Delivery, settlement: Settlement, future: Future[None]) -> None:
        """Done-callback of a settlement (maybe on the broker client's thread)."""
        error = future.exception()
        if error is None:
            return
        # The broker did not take the settlement; it still holds the message unacked and will
        # redeliver it, and the guard turns the redelivery into a DUPLICATE.
        log.error("settling %s as %s failed", delivery.describe(), settlement, exc_info=error)
        with self._stats_lock:
            self.stats.settle_failures += 1

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
            if verdict is Verdict.HANDLER_ERROR:
                log.warning(
                    "handler failed on %s (attempt %d)",
                    delivery.describe(),
                    delivery.delivery_attempt,
                    exc_info=True,
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
        backoff_s = 0.5
        ready = False
        while not self.stopping.is_set():
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
                        log.info("idemq worker ready: %s", self.description)
                    if delivery is None:
                        slots.release()
                    yield delivery
                    backoff_s = 0.5
                return
            except StopIteration:
                return
            except BrokerError:
                log.exception("broker failed; reconnecting in %.1fs", backoff_s)
                self.stopping.wait(backoff_s)
                backoff_s = min(backoff_s * 2, 30.0)
            finally:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()


def run_worker(
    handler: str | Handler,
    *,
    broker_url: str,
    queue: str,
    store_url: str,
    consumer: str | None = None,
    concurrency: int = 1,
    prefetch: int | None = None,
    max_attempts: int = 5,
    install_signal_handlers: bool = True,
    on_start: Callable[[Worker], None] | None = None,
    metrics_port: int | None = None,
    batch_size: int | None = None,
    batch_wait_ms: int = 50,
) -> WorkerStats:
    """What ``idemq worker MODULE:HANDLER --broker URL --queue NAME --store URL`` runs.

    ``consumer`` scopes the dedup keys (default: the queue name). Returns when SIGTERM/SIGINT
    arrives (or ``worker.stop()`` is called from ``on_start``'s thread), after in-flight messages
    are settled. ``metrics_port``: serve Prometheus metrics there (``idemq.metrics``); outcomes
    are logged on ``idemq.guard`` with structured fields either way. ``batch_size``: guard up
    to that many deliveries per transaction (``idemq.batching``), waiting ``batch_wait_ms`` at
    most for a batch to fill.
    """
    batch = None if batch_size is None else BatchSettings(batch_size, batch_wait_ms)
    fn = load_handler(handler) if isinstance(handler, str) else handler
    guard = open_guard(store_url, consumer or queue)
    stop_metrics: Callable[[], None] = lambda: None  # noqa: E731
    try:
        guard.observer, stop_metrics = worker_observer(guard.store, metrics_port)
        broker = open_broker(broker_url)
    except BaseException:
        stop_metrics()
        guard.store.close()
        raise
    worker = Worker(
        fn,
        broker,
        guard,
        queue,
        concurrency=concurrency,
        prefetch=prefetch,
        policy=RetryPolicy(max_attempts=max_attempts),
        observer=guard.observer,
        description=(
            f"broker={mask_url(broker_url)} queue={queue} store={mask_url(store_url)}"
            f" concurrency={concurrency}"
            + ("" if batch is None else f" batch_size={batch.size} batch_wait_ms={batch.wait_ms}")
        ),
        batch=batch,
    )
    try:
        if on_start is not None:
            on_start(worker)
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            return _run_with_signals(worker)
        return worker.run()
    finally:
        stop_metrics()
        guard.store.close()


def _run_with_signals(worker: Worker) -> WorkerStats:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %s: finishing in-flight messages, then exiting", signum)
        worker.stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return worker.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
