"""One chaos worker process: the real :class:`idemq.worker.Worker`, with faults around it.

* the guard is the real :class:`idemq.Idempotency` (or, with ``guard=False``, a pass-through that
  just runs the handler in a plain transaction — the consumer idemq replaces);
* **slow** (cause 2): a share of first deliveries stall for 1.5 x the broker's redelivery timer;
* **armed kill** (cause 3): after SIGUSR1 from the supervisor, the worker SIGKILLs itself at the
  next ack — the effect is committed, the ack never leaves; first it writes (and fsyncs) a crash
  marker naming the message to its event file, so the redelivered copy is attributed to the
  crash from the deliveries themselves;
* every delivery is logged to the :class:`~idemq.chaos.events.EventLog` before the guard and
  after settlement, so the runner can tell which cause produced which duplicate.

Two-hop runs (``role``): a ``pay`` worker also adds the order's ``ship`` message to the outbox
in the payment's transaction; ``relay`` processes run the real :class:`~idemq.OutboxRelay` to
the ship queue (stamping their pid on each copy; an armed relay dies right after a confirmed
publish, before the row's delete); ``ship`` workers consume it and record the shipment.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import sqlalchemy as sa

from idemq.brokers import open_broker
from idemq.brokers.base import Broker, Delivery, Received
from idemq.brokers.settlement import RetryPolicy
from idemq.chaos.events import COPY_HEADER, RELAY_HEADER, EventLog
from idemq.chaos.orders import OrderService, make_engine, parse_body
from idemq.guard.core import Outcome, Status
from idemq.guard.idempotency import Idempotency
from idemq.message import Message
from idemq.outbox.outbox import Outbox
from idemq.outbox.relay import OutboxRelay
from idemq.stores.sql.store import SqlStore
from idemq.worker.loop import Worker

__all__ = ["WorkerSpec", "run"]

RELAY_LEASE_S = 2.0  # SQLite relays: a killed relay's rows are taken over this soon

# Retry quickly: a chaos run is short, and IN_PROGRESS twins should come back soon.
CHAOS_POLICY = RetryPolicy(
    max_attempts=1000,  # never dead-letter a good message because the run was violent
    backoff_base_s=0.1,
    backoff_max_s=1.0,
    in_progress_delay_s=0.5,
    store_unavailable_delay_s=0.5,
)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs (picklable: it crosses a process boundary)."""

    broker_url: str
    queue: str
    store_url: str  # SQLAlchemy URL, or redis:// (lease mode)
    ledger_url: str  # where the order tables live (the store's DB for a SQL store)
    prefix: str  # table / key prefix of this run
    consumer: str
    events_dir: str
    guard: bool
    slow_rate: float
    slow_s: float
    slow_before_claim: bool  # SQLite: stalling inside the transaction would block every writer
    lease_s: float
    seed: int
    # Two-hop runs: "pay" workers also add a ship message to the outbox in their transaction,
    # "relay" processes publish the outbox to ``ship_queue``, "ship" workers consume it.
    role: str = "pay"
    ship_queue: str = ""  # empty: one hop (pay only)
    outbox_table: str = ""
    # Every first delivery's handler waits this long after its effect, before the commit (the
    # cut host of ``--hosts``: so that it holds a message, a transaction open, when it goes dark).
    pause_s: float = 0.0


class _Faulty(Delivery):
    """Delegates settlement to the real delivery; dies before the ack when armed."""

    def __init__(self, inner: Delivery, armed: threading.Event, log: EventLog) -> None:
        super().__init__(
            Received(
                inner.queue,
                inner.body,
                inner.headers,
                inner.message,
                inner.decode_error,
                inner.delivery_attempt,
                inner.not_before_ms,
            )
        )
        self.inner = inner
        self._armed = armed
        self._log = log

    def _ack(self) -> Future[None]:
        if self._armed.is_set():
            # The effect is committed; the ack never leaves. The broker must redeliver. The
            # crash marker names the message, on disk before the kill: the runner reads the
            # cause of its next copy from it, not from when the supervisor noticed the death.
            message_id = self.message.id if self.message is not None else None
            self._log.write("kill", durable=True, id=message_id, where="after_commit_before_ack")
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.ack()  # its future: a failed ack is counted, not dropped

    def _retry(self, delay_s: float, counted: bool) -> Future[None]:
        return self.inner.retry(delay_s, counted=counted)

    def _dead_letter(self, reason: str) -> Future[None]:
        return self.inner.dead_letter(reason)


class _FaultyBroker:
    """Wraps the worker's broker so every delivery is a :class:`_Faulty` one."""

    def __init__(self, inner: Broker, armed: threading.Event, log: EventLog) -> None:
        self.inner = inner
        self._armed = armed
        self._log = log

    def consume(self, queue: str, *, prefetch: int) -> Iterator[Delivery | None]:
        for delivery in self.inner.consume(queue, prefetch=prefetch):
            yield None if delivery is None else _Faulty(delivery, self._armed, self._log)

    def declare(self, queue: str) -> None:
        self.inner.declare(queue)

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
    ) -> None:
        self.inner.publish(queue, body, headers=headers, message_id=message_id)

    def dead_letter_queue(self, queue: str) -> str:
        return self.inner.dead_letter_queue(queue)

    def delete_queue(self, queue: str) -> None:
        self.inner.delete_queue(queue)

    def close(self) -> None:
        self.inner.close()


class _ChaosGuard:
    """Logs each delivery around the real guard (or around no guard at all) and makes some slow."""

    def __init__(
        self,
        spec: WorkerSpec,
        guard: Idempotency | None,
        ledger: sa.Engine,
        log: EventLog,
    ) -> None:
        self.spec = spec
        self.guard = guard
        self.ledger = ledger
        self.log = log
        self.rng = random.Random(spec.seed ^ os.getpid())
        self._seq = 0
        self._lock = threading.Lock()
        self.current: dict[str, Message] = {}

    def process(
        self,
        message_id: str,
        handler: Callable[[Any], Any],
        *,
        business_id: str | None = None,
        payload: object = None,
    ) -> Outcome[Any]:
        message = self.current.pop(message_id, None)
        attempt = message.delivery_attempt if message else 1
        with self._lock:
            self._seq += 1
            seq = self._seq
            # First attempts only: a slow redelivery could be slow again, forever.
            slow = attempt == 1 and self.rng.random() < self.spec.slow_rate
        copy = int(message.headers.get(COPY_HEADER, "1")) if message else 1
        relay = int(message.headers.get(RELAY_HEADER, "0")) if message else 0
        self.log.write("start", seq=seq, id=message_id, copy=copy, relay=relay, slow=slow)
        verdict = "handler_error"
        try:
            if slow and self.spec.slow_before_claim:
                time.sleep(self.spec.slow_s)
            if slow and not self.spec.slow_before_claim:
                run = self._slowly(handler, self.spec.slow_s)
            elif self.spec.pause_s > 0 and not self.spec.slow_before_claim:
                run = self._slowly(handler, self.spec.pause_s)
            else:
                run = handler
            outcome = self._guarded(message_id, run, business_id, payload)
            verdict = outcome.status.value
            return outcome
        finally:
            self.log.write("done", seq=seq, id=message_id, v=verdict)

    def _slowly(self, handler: Callable[[Any], Any], seconds: float) -> Callable[[Any], Any]:
        def run(tx: Any) -> Any:
            result = handler(tx)
            time.sleep(seconds)  # effect written, not committed: the twin must wait
            return result

        return run

    def _guarded(
        self, message_id: str, run: Callable[[Any], Any], business_id: str | None, payload: object
    ) -> Outcome[Any]:
        if self.guard is None:
            with self.ledger.begin() as tx:
                result = run(tx)
            return Outcome(Status.PROCESSED, message_id, result)
        if self.guard.mode.value == "lease":

            def own_tx(_: Any) -> Any:
                with self.ledger.begin() as tx:
                    return run(tx)

            return self.guard.process(message_id, own_tx, business_id=business_id, payload=payload)
        return self.guard.process(message_id, run, business_id=business_id, payload=payload)


def _open_guard(spec: WorkerSpec) -> tuple[Idempotency | None, sa.Engine]:
    if not spec.guard:
        return None, make_engine(spec.ledger_url)
    if spec.store_url.startswith(("redis://", "rediss://")):
        from idemq.stores.redis.store import RedisStore  # noqa: PLC0415

        store = RedisStore(spec.store_url, prefix=f"{spec.prefix}idemq")
        guard = Idempotency(store, consumer=spec.consumer, mode="lease", lease_s=spec.lease_s)
        return guard, make_engine(spec.ledger_url)
    sql = SqlStore(spec.store_url, table=f"{spec.prefix}dedup")
    return Idempotency(sql, consumer=spec.consumer), sql.engine


def run(spec: WorkerSpec) -> None:
    """The process body: consume (or relay) until SIGTERM, or until killed."""
    armed = threading.Event()

    def on_arm(signum: int, frame: FrameType | None) -> None:
        armed.set()

    # First thing: SIGUSR1's default action is to terminate, and the supervisor may arm a
    # worker that is still starting.
    signal.signal(signal.SIGUSR1, on_arm)
    # Expected noise under chaos (late acks, reconnects) would drown the progress display.
    logging.getLogger("idemq").setLevel(logging.ERROR)
    log = EventLog(Path(spec.events_dir))
    try:
        if spec.role == "relay":
            _relay(spec, armed, log)
        else:
            _consume(spec, armed, log)
    finally:
        log.close()


def _consume(spec: WorkerSpec, armed: threading.Event, log: EventLog) -> None:
    guard, ledger = _open_guard(spec)
    service = OrderService(prefix=spec.prefix)
    lease = guard is not None and guard.mode.value == "lease"
    chaos_guard = _ChaosGuard(spec, guard, ledger, log)
    outbox = _outbox(spec, guard) if spec.role == "pay" and spec.ship_queue else None

    def handle(msg: Message, tx: Any) -> dict[str, Any]:
        _, order_id = parse_body(msg)
        if spec.role == "ship":
            return {"shipped": service.ship_unconditionally(tx, order_id, msg.id)}
        if lease:
            # Lease mode: a kill between effect and `complete` re-runs the effect, so the
            # business guard (state machine) must absorb it — the README's guarantee table.
            return {"pay": service.pay(tx, order_id, msg.id).value}
        debited = service.pay_unconditionally(tx, order_id, msg.id)
        if outbox is None:
            return {"debited": debited}
        # The next hop's message, in the payment's transaction: both commit or neither.
        body = json.dumps({"event": "ship", "order_id": order_id}).encode()
        return {"debited": debited, "ship": outbox.add(tx, spec.ship_queue, body)}

    broker = _FaultyBroker(open_broker(spec.broker_url), armed, log)
    worker = Worker(
        handle,
        _Remembering(broker, chaos_guard),
        chaos_guard,
        spec.queue,
        concurrency=1,
        policy=CHAOS_POLICY,
    )

    def on_term(signum: int, frame: FrameType | None) -> None:
        worker.stop()

    signal.signal(signal.SIGTERM, on_term)
    try:
        worker.run()
    finally:
        if guard is not None:
            guard.store.close()
        ledger.dispose()


def _outbox(spec: WorkerSpec, guard: Idempotency | None) -> Outbox:
    # Guarded: the guard's own store, so the row joins the dedup transaction. Unguarded: a
    # store on the same database, used for its engine only (the handler's tx is the ledger's).
    store = guard.store if guard is not None else SqlStore(spec.store_url)
    return Outbox(store, table=spec.outbox_table)


class _RelayBroker(_FaultyBroker):
    """The relay's broker: stamps the relay's pid on every copy; dies after a confirmed publish
    when armed — the row is still in the outbox, so another relay publishes it again."""

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
    ) -> None:
        stamped = {**(headers or {}), RELAY_HEADER: str(os.getpid())}
        self.inner.publish(queue, body, headers=stamped, message_id=message_id)
        if self._armed.is_set():
            where = "after_publish_before_delete"
            self._log.write("kill", durable=True, id=message_id, where=where)
            os.kill(os.getpid(), signal.SIGKILL)


def _relay(spec: WorkerSpec, armed: threading.Event, log: EventLog) -> None:
    """An :class:`~idemq.OutboxRelay` publishing the pay workers' outbox to the ship queue."""
    store = SqlStore(spec.store_url)
    broker = _RelayBroker(open_broker(spec.broker_url), armed, log)
    relay = OutboxRelay(
        Outbox(store, table=spec.outbox_table),
        broker,
        batch_size=10,
        poll_s=0.2,
        lease_s=RELAY_LEASE_S,
        backoff_s=0.1,
        max_backoff_s=1.0,
    )
    stop = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    try:
        relay.run(stop)
    finally:
        relay.close()
        broker.close()
        store.close()


class _Remembering(_FaultyBroker):
    """Hands each decoded message to the guard wrapper (which needs its headers and attempt)."""

    def __init__(self, inner: _FaultyBroker, chaos_guard: _ChaosGuard) -> None:
        super().__init__(inner.inner, inner._armed, inner._log)
        self._chaos_guard = chaos_guard

    def consume(self, queue: str, *, prefetch: int) -> Iterator[Delivery | None]:
        for delivery in super().consume(queue, prefetch=prefetch):
            if delivery is not None and delivery.message is not None:
                self._chaos_guard.current[delivery.message.id] = delivery.message
            yield delivery


def run_from_file(path: str) -> None:
    """:func:`run` with the spec a JSON file holds, for a process that must start elsewhere than
    in the supervisor's fork server (a host of ``idemq chaos --hosts``, started inside its
    network namespace: see :class:`~idemq.chaos.hosts.HostProcess`)."""
    run(WorkerSpec(**json.loads(Path(path).read_text())))
