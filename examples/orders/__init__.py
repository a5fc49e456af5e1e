"""A small order service made idempotent with idemq: dedup table + state machine + debit.

Used by ``idemq demo``, the chaos runner, the docs and ``tests/integration/test_orders_example.py``.

* :mod:`examples.orders.schema`     — tables ``orders``/``accounts``/``ledger`` (with a prefix)
* :mod:`examples.orders.handlers`   — ``handle(msg, tx)`` for ``pay`` and ``ship``
* :mod:`examples.orders.invariants` — ``check_invariants`` → counts + violations
"""

from examples.orders.handlers import (
    InsufficientFundsError,
    OrderService,
    RetryLaterError,
    handle,
    order_machine,
)
from examples.orders.invariants import InvariantReport, Violation, check_invariants
from examples.orders.schema import (
    ORDER_STATES,
    OrderTables,
    create_schema,
    drop_schema,
    make_async_engine,
    make_engine,
    seed,
)

__all__ = [
    "ORDER_STATES",
    "InsufficientFundsError",
    "InvariantReport",
    "OrderService",
    "OrderTables",
    "RetryLaterError",
    "Violation",
    "check_invariants",
    "create_schema",
    "drop_schema",
    "handle",
    "make_async_engine",
    "make_engine",
    "order_machine",
    "seed",
]
