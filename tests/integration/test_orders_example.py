"""The order-service example end to end: dedup guard + state machine + debit in one transaction.

Runs on SQLite, PostgreSQL and MariaDB, and checks the business effect (balances, ledger rows,
dedup rows) with the example's own invariant checker — which is itself tested on a run that was
deliberately corrupted.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from examples.orders import (
    InsufficientFundsError,
    OrderService,
    RetryLaterError,
    check_invariants,
    create_schema,
    drop_schema,
    seed,
)
from examples.orders import handlers as handlers_module
from sqlalchemy import func, insert, select, update

import idemq
from idemq.business.state_machine import TransitionResult
from idemq.errors import InvalidMessageError
from tests.conftest import unique

WORKERS = 8
OPENING = 10_000
AMOUNT = 1_500


@dataclass
class Shop:
    store: idemq.SqlStore
    guard: idemq.Idempotency
    service: OrderService

    def deliver(self, message_id: str, event: str, order_id: str = "o1") -> idemq.Outcome[Any]:
        """What ``idemq worker examples.orders.handlers:handle`` does with one delivery."""
        body = json.dumps({"event": event, "order_id": order_id}).encode()
        msg = idemq.Message(id=message_id, body=body)
        return self.guard.process(
            msg.id, lambda tx: self.service.handle(msg, tx), business_id=order_id, payload=body
        )

    def balance(self, account_id: str = "a1") -> int:
        accounts = self.service.tables.accounts
        with self.store.engine.connect() as c:
            q = select(accounts.c.balance).where(accounts.c.account_id == account_id)
            return int(c.execute(q).scalar_one())

    def status(self, order_id: str = "o1") -> str:
        orders = self.service.tables.orders
        with self.store.engine.connect() as c:
            q = select(orders.c.status).where(orders.c.order_id == order_id)
            return str(c.execute(q).scalar_one())

    def dedup_rows(self) -> int:
        with self.store.engine.connect() as c:
            return int(c.execute(select(func.count()).select_from(self.store.table)).scalar_one())

    def report(self) -> Any:
        return check_invariants(self.store.engine, self.service.tables)


@pytest.fixture
def shop(sql_url: str) -> Iterator[Shop]:
    store = idemq.SqlStore(sql_url, table=unique("mi"))
    store.create_schema()
    service = OrderService(prefix=unique("ord") + "_")
    create_schema(store.engine, service.tables)
    with store.engine.begin() as conn:
        seed(
            conn,
            service.tables,
            accounts={"a1": OPENING, "poor": 100},
            orders=[("o1", "a1", AMOUNT), ("o2", "a1", AMOUNT), ("o3", "poor", AMOUNT)],
        )
    guard = idemq.Idempotency(store, consumer=unique("order-service"))
    try:
        yield Shop(store, guard, service)
    finally:
        drop_schema(store.engine, service.tables)
        store.drop_schema()
        store.close()


def test_pay_redelivery_resend_and_ship(shop: Shop) -> None:
    first = shop.deliver("m1", "pay")
    assert first.status is idemq.Status.PROCESSED
    assert first.result == {"order_id": "o1", "event": "pay", "result": "APPLIED"}
    again = shop.deliver("m1", "pay")  # broker redelivery: the dedup table answers
    assert again.status is idemq.Status.DUPLICATE
    assert again.result == first.result
    resent = shop.deliver("m1-resent", "pay")  # producer retry with a new id: the state machine
    assert resent.status is idemq.Status.PROCESSED
    assert resent.result["result"] == "ALREADY_APPLIED"
    assert shop.deliver("m2", "ship").result["result"] == "APPLIED"
    assert shop.deliver("m3", "pay").result["result"] == "ALREADY_APPLIED"  # paying a SHIPPED order

    assert shop.balance() == OPENING - AMOUNT
    assert shop.status() == "SHIPPED"
    report = shop.report()
    assert report.ok, report.violations
    assert (report.debits, report.paid_orders, report.debited_cents) == (1, 1, AMOUNT)


def test_ship_before_pay_rolls_back_and_succeeds_on_retry(shop: Shop) -> None:
    with pytest.raises(RetryLaterError) as info:
        shop.deliver("ship-1", "ship")
    assert info.value.verdict is TransitionResult.REJECTED
    # The dedup row rolled back with the refusal, so the retry is not taken for a duplicate.
    assert shop.store.get("ship-1", shop.guard.consumer) is None
    assert shop.status() == "PENDING_PAYMENT"

    assert shop.deliver("pay-1", "pay").result["result"] == "APPLIED"
    retried = shop.deliver("ship-1", "ship")
    assert retried.status is idemq.Status.PROCESSED
    assert retried.result["result"] == "APPLIED"
    assert shop.status() == "SHIPPED"
    assert shop.dedup_rows() == 2
    assert shop.report().ok


def test_unknown_order_is_retried_not_recorded(shop: Shop) -> None:
    with pytest.raises(RetryLaterError) as info:
        shop.deliver("m1", "pay", order_id="o-missing")
    assert info.value.verdict is TransitionResult.NOT_FOUND
    assert shop.dedup_rows() == 0


def test_insufficient_funds_rolls_back_the_transition(shop: Shop) -> None:
    with pytest.raises(InsufficientFundsError):
        shop.deliver("m1", "pay", order_id="o3")
    assert shop.status("o3") == "PENDING_PAYMENT"
    assert shop.balance("poor") == 100
    assert shop.dedup_rows() == 0
    assert shop.report().ok


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[1]", b'{"event": "refund", "order_id": "o1"}', b'{"event": "pay"}'],
)
def test_malformed_body_is_invalid_and_writes_nothing(shop: Shop, body: bytes) -> None:
    msg = idemq.Message(id="bad", body=body)
    with pytest.raises(InvalidMessageError):
        shop.guard.process(msg.id, lambda tx: shop.service.handle(msg, tx))
    assert shop.dedup_rows() == 0
    assert shop.status() == "PENDING_PAYMENT"


@pytest.mark.slow
def test_racing_pay_messages_with_distinct_ids_debit_once(shop: Shop) -> None:
    barrier = threading.Barrier(WORKERS)
    outcomes: list[idemq.Outcome[Any]] = []
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            barrier.wait(timeout=30)
            outcomes.append(shop.deliver(f"pay-o1-copy-{n}", "pay"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(WORKERS)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert time.monotonic() - started < 120
    assert not errors, errors
    assert all(o.status is idemq.Status.PROCESSED for o in outcomes)
    verdicts = sorted(o.result["result"] for o in outcomes)
    assert verdicts == ["ALREADY_APPLIED"] * (WORKERS - 1) + ["APPLIED"]
    assert shop.balance() == OPENING - AMOUNT
    assert shop.dedup_rows() == WORKERS
    report = shop.report()
    assert report.ok, report.violations
    assert report.debits == 1


def test_invariant_checker_reports_each_violation(shop: Shop) -> None:
    tables = shop.service.tables
    assert shop.deliver("m1", "pay").result["result"] == "APPLIED"
    with shop.store.engine.begin() as c:
        # o1: debited a second time (what a missing guard would do)
        c.execute(
            insert(tables.ledger).values(
                order_id="o1", account_id="a1", amount=AMOUNT, message_id="rogue"
            )
        )
        # o2: shipped without being paid; a1's balance no longer matches its ledger
        c.execute(
            update(tables.orders).where(tables.orders.c.order_id == "o2").values(status="SHIPPED")
        )
        c.execute(
            update(tables.accounts).where(tables.accounts.c.account_id == "poor").values(balance=-5)
        )
    report = shop.report()
    kinds = sorted((v.kind, v.subject) for v in report.violations)
    assert kinds == [
        ("balance_mismatch", "a1"),
        ("balance_mismatch", "poor"),
        ("double_debit", "o1"),
        ("missing_debit", "o2"),
        ("negative_balance", "poor"),
        ("shipped_unpaid", "o2"),
    ]
    assert not report.ok
    as_json = json.loads(json.dumps(report.to_dict()))
    assert as_json["ok"] is False
    assert as_json["by_status"] == {"SHIPPED": 1, "PAID": 1, "PENDING_PAYMENT": 1}


def test_module_level_handle_has_the_worker_shape() -> None:
    # ``idemq worker examples.orders.handlers:handle`` imports exactly this callable.
    assert callable(handlers_module.handle)
    assert handlers_module.handle.__code__.co_varnames[:2] == ("msg", "tx")
