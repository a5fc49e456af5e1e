"""Check a finished run of the order service: did every effect land exactly once?

Rules (each broken rule is one :class:`Violation`):

* ``double_debit``        — an order has more than one ledger debit;
* ``missing_debit``       — an order is PAID or SHIPPED but has no debit;
* ``debit_unpaid``        — an order has a debit but is still PENDING_PAYMENT / PAYMENT_FAILED;
* ``debit_amount``        — a debit's amount or account differs from the order's;
* ``shipped_unpaid``      — an order is SHIPPED without ever having been paid (no ``paid_by``);
* ``balance_mismatch``    — ``balance != opening_balance - sum(debits)`` for an account;
* ``negative_balance``    — an account went below zero.

Reads use plain SELECTs; run it after the workers stopped (it is not a snapshot of a live run).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import Engine, select

from idemq.chaos.orders import OrderTables

__all__ = ["InvariantReport", "ShipmentReport", "Violation", "check_invariants", "check_shipments"]

_PAID_STATES = frozenset({"PAID", "SHIPPED"})


@dataclass(frozen=True)
class Violation:
    """One broken rule: ``kind`` (see module docstring), the order/account, and a detail."""

    kind: str
    subject: str
    detail: str


@dataclass
class InvariantReport:
    """Counts and violations of one run; ``ok`` is True when there are no violations."""

    orders: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    paid_orders: int = 0
    debits: int = 0
    debited_cents: int = 0
    accounts: int = 0
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every rule held."""
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what the chaos runner prints)."""
        return {**asdict(self), "ok": self.ok}


def check_invariants(engine: Engine, tables: OrderTables) -> InvariantReport:
    """Read the three tables and check every rule; never raises for a broken rule."""
    orders_t, accounts_t, ledger_t = tables.orders, tables.accounts, tables.ledger
    with engine.connect() as conn:
        orders = conn.execute(
            select(
                orders_t.c.order_id,
                orders_t.c.account_id,
                orders_t.c.status,
                orders_t.c.amount,
                orders_t.c.paid_by,
            )
        ).all()
        accounts = conn.execute(
            select(accounts_t.c.account_id, accounts_t.c.balance, accounts_t.c.opening_balance)
        ).all()
        debits = conn.execute(
            select(ledger_t.c.order_id, ledger_t.c.account_id, ledger_t.c.amount)
        ).all()

    report = InvariantReport(
        orders=len(orders),
        by_status=dict(Counter(o.status for o in orders)),
        paid_orders=sum(o.status in _PAID_STATES for o in orders),
        debits=len(debits),
        debited_cents=sum(d.amount for d in debits),
        accounts=len(accounts),
    )
    flag = report.violations.append
    debits_of: dict[str, list[Any]] = defaultdict(list)
    for d in debits:
        debits_of[d.order_id].append(d)

    for o in orders:
        mine = debits_of.get(o.order_id, [])
        paid = o.status in _PAID_STATES
        if len(mine) > 1:
            flag(Violation("double_debit", o.order_id, f"{len(mine)} debits"))
        if paid and not mine:
            flag(Violation("missing_debit", o.order_id, f"status {o.status} but no debit"))
        if not paid and mine:
            flag(Violation("debit_unpaid", o.order_id, f"status {o.status} but debited"))
        for d in mine:
            if (d.amount, d.account_id) != (o.amount, o.account_id):
                detail = f"debit {d.amount} from {d.account_id}, order {o.amount} / {o.account_id}"
                flag(Violation("debit_amount", o.order_id, detail))
        if o.status == "SHIPPED" and o.paid_by is None:
            flag(Violation("shipped_unpaid", o.order_id, "SHIPPED with no paid_by"))

    debited: Counter[str] = Counter()
    for d in debits:
        debited[d.account_id] += d.amount
    for a in accounts:
        expected = a.opening_balance - debited[a.account_id]
        if a.balance != expected:
            detail = f"balance {a.balance}, expected {expected}"
            flag(Violation("balance_mismatch", a.account_id, detail))
        if a.balance < 0:
            flag(Violation("negative_balance", a.account_id, f"balance {a.balance}"))
    return report


@dataclass
class ShipmentReport:
    """The second hop of a two-hop run: each paid order shipped exactly once, nothing else.

    ``shipped`` orders with a shipment, ``double_shipped`` those with more than one,
    ``unshipped`` paid orders with none, ``shipped_unpaid`` shipments of an order never debited
    (a ship message published for a payment that rolled back).
    """

    shipments: int = 0
    shipped: int = 0
    double_shipped: int = 0
    unshipped: int = 0
    shipped_unpaid: int = 0

    @property
    def ok(self) -> bool:
        """True when every paid order has exactly one shipment and no other order has one."""
        return self.double_shipped == self.unshipped == self.shipped_unpaid == 0


def check_shipments(engine: Engine, tables: OrderTables) -> ShipmentReport:
    """Compare the shipments with the debits (plain SELECTs, after the run)."""
    with engine.connect() as conn:
        shipped = Counter(
            str(order_id) for (order_id,) in conn.execute(select(tables.shipments.c.order_id)).all()
        )
        paid = {str(order_id) for (order_id,) in conn.execute(select(tables.ledger.c.order_id))}
    return ShipmentReport(
        shipments=sum(shipped.values()),
        shipped=len(shipped),
        double_shipped=sum(1 for n in shipped.values() if n > 1),
        unshipped=len(paid - shipped.keys()),
        shipped_unpaid=len(shipped.keys() - paid),
    )
