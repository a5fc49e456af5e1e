"""``idemq demo``: the three causes of duplicates, produced for real, on SQLite — no servers.

A producer publishes payment messages to an embedded at-least-once queue (a SQLite file with a
visibility timeout). Worker *processes* consume them and debit an account in a second SQLite
file that also holds the dedup table. Along the way, duplicates are made the way production
makes them:

1. **partition → confirm timeout → producer retry**: for some messages the producer never hears
   the confirm and publishes the same message id again;
2. **slow consumer → redelivery**: some handlers outlast the queue's visibility timeout, so the
   queue hands the same message to another worker while the first copy still runs;
3. **crash after the effect, before the ack**: some workers are SIGKILLed right after their
   transaction committed and before they acknowledged; the message comes back after restart.

At the end the ledger is checked: every message paid exactly once (``--no-guard`` runs the same
workload without idemq, so the double payments it prevents are visible).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from idemq.brokers.embedded import EmbeddedBroker
from idemq.core import Status
from idemq.idempotency import Idempotency
from idemq.ids import MessageIdGenerator
from idemq.message import Message
from idemq.stores.sql import SqlStore

__all__ = ["DemoConfig", "DemoReport", "default_directory", "run_demo"]

QUEUE = "payments"
START_BALANCE = 1_000_000


@dataclass(frozen=True)
class DemoConfig:
    """Knobs of the demo (the defaults finish in well under a minute on 2 cores)."""

    directory: Path
    orders: int = 120
    workers: int = 3
    guard: bool = True
    retry_rate: float = 0.2  # cause 1: share of publishes whose confirm "times out"
    slow_rate: float = 0.04  # cause 2: share of deliveries that outlast the visibility timeout
    crash_rate: float = 0.04  # cause 3: share of deliveries SIGKILLed between commit and ack
    visibility_timeout_s: float = 1.0
    seed: int = 7


@dataclass
class DemoReport:
    """What happened, and the verdict on the ledger."""

    produced: int = 0
    published: int = 0
    duplicates_published: int = 0
    crashes: int = 0
    payments: int = 0
    double_paid: int = 0
    lost: int = 0
    balance: int = 0
    expected_balance: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.double_paid == 0 and self.lost == 0 and self.balance == self.expected_balance


def _ledger(engine: sa.Engine) -> tuple[sa.Table, sa.Table]:
    meta = sa.MetaData()
    accounts = sa.Table(
        "demo_accounts",
        meta,
        sa.Column("account_id", sa.Integer, primary_key=True),
        sa.Column("balance", sa.BigInteger, nullable=False),
    )
    payments = sa.Table(
        "demo_payments",
        meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("order_id", sa.String(64), nullable=False),  # no UNIQUE: the guard is the test
        sa.Column("amount", sa.Integer, nullable=False),
    )
    meta.create_all(engine)
    return accounts, payments


def _pay(accounts: sa.Table, payments: sa.Table, msg: Message, tx: sa.Connection) -> dict[str, Any]:
    order = msg.json()
    tx.execute(
        accounts.update()
        .where(accounts.c.account_id == 1)
        .values(balance=accounts.c.balance - order["amount"])
    )
    tx.execute(payments.insert().values(order_id=order["order_id"], amount=order["amount"]))
    return {"paid": order["amount"]}


def _worker(config: DemoConfig, number: int, outcomes: Any) -> None:
    """One worker process: consume, guard, commit, maybe crash, ack."""
    rng = random.Random(config.seed * 1000 + number + os.getpid())
    broker = EmbeddedBroker(
        config.directory / "queue.db", visibility_timeout_s=config.visibility_timeout_s
    )
    store = SqlStore(f"sqlite:///{config.directory / 'ledger.db'}")
    accounts, payments = _ledger(store.engine)
    guard = Idempotency(store, consumer="payments")

    def handler(msg: Message) -> Callable[[sa.Connection], Any]:
        def run(tx: sa.Connection) -> Any:
            if rng.random() < config.slow_rate:  # cause 2: outlast the visibility timeout
                time.sleep(config.visibility_timeout_s * 1.3)
            return _pay(accounts, payments, msg, tx)

        return run

    for delivery in broker.consume(QUEUE):
        if delivery is None:
            continue
        msg = delivery.message
        assert msg is not None
        if config.guard:
            status = guard.process(msg.id, handler(msg), payload=msg.body).status
        else:
            with store.engine.begin() as tx:
                handler(msg)(tx)
            status = Status.PROCESSED
        outcomes.put(status.value)
        if status is Status.IN_PROGRESS:
            delivery.retry(0.2)
            continue
        if rng.random() < config.crash_rate:  # cause 3: committed, not acked
            outcomes.close()
            outcomes.join_thread()  # let the parent hear this delivery's outcome before dying
            os.kill(os.getpid(), signal.SIGKILL)
        delivery.ack()


def _publish(config: DemoConfig, report: DemoReport) -> dict[str, int]:
    """The producer; returns order_id → amount of every distinct message produced."""
    rng = random.Random(config.seed)
    broker = EmbeddedBroker(config.directory / "queue.db")
    ids = MessageIdGenerator(prefix="PAY", node="DEMO01")
    orders: dict[str, int] = {}
    for n in range(config.orders):
        order_id, amount = f"order_{n:05d}", rng.randint(1, 500)
        body = f'{{"order_id": "{order_id}", "amount": {amount}}}'.encode()
        message_id = ids.next_id()
        broker.publish(QUEUE, body, message_id=message_id)
        report.published += 1
        if rng.random() < config.retry_rate:  # cause 1: the confirm timed out, publish again
            broker.publish(QUEUE, body, message_id=message_id)
            report.published += 1
            report.duplicates_published += 1
        orders[order_id] = amount
    broker.close()
    report.produced = len(orders)
    return orders


def run_demo(config: DemoConfig, progress: Callable[[str], None] = lambda _: None) -> DemoReport:
    """Run the whole story and return the report (the CLI renders it)."""
    started = time.monotonic()
    report = DemoReport()
    store = SqlStore(f"sqlite:///{config.directory / 'ledger.db'}")
    store.create_schema()
    accounts, payments = _ledger(store.engine)
    with store.engine.begin() as conn:
        conn.execute(accounts.insert().values(account_id=1, balance=START_BALANCE))
    orders = _publish(config, report)
    progress(
        f"published {report.published} messages for {report.produced} orders "
        f"({report.duplicates_published} producer retries)"
    )

    ctx = multiprocessing.get_context("fork")
    outcomes = ctx.Queue()
    procs = {
        n: ctx.Process(target=_worker, args=(config, n, outcomes), daemon=True)
        for n in range(config.workers)
    }
    for proc in procs.values():
        proc.start()
    queue = EmbeddedBroker(config.directory / "queue.db")
    counts: dict[str, int] = {}
    while queue.depth(QUEUE):
        time.sleep(0.1)
        while not outcomes.empty():
            kind = outcomes.get()
            counts[kind] = counts.get(kind, 0) + 1
        for n, proc in list(procs.items()):
            if not proc.is_alive():  # the supervisor restarts killed workers
                report.crashes += 1
                procs[n] = ctx.Process(target=_worker, args=(config, n, outcomes), daemon=True)
                procs[n].start()
                progress(f"worker {n} was killed after commit, before ack; restarted")
    for proc in procs.values():
        proc.kill()
        proc.join()
    while not outcomes.empty():
        kind = outcomes.get()
        counts[kind] = counts.get(kind, 0) + 1
    queue.close()
    report.outcomes = counts

    with store.engine.connect() as conn:
        paid: dict[str, int] = dict(
            conn.execute(
                sa.select(payments.c.order_id, sa.func.count()).group_by(payments.c.order_id)
            ).all()
        )
        report.balance = conn.execute(sa.select(accounts.c.balance)).scalar_one()
    store.close()
    report.payments = sum(paid.values())
    report.double_paid = len([n for n in paid.values() if n > 1])
    report.lost = len(orders.keys() - paid.keys())
    report.expected_balance = START_BALANCE - sum(orders.values())
    report.seconds = time.monotonic() - started
    return report


def default_directory() -> Path:
    return Path(tempfile.mkdtemp(prefix="idemq-demo-"))
