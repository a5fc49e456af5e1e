"""Tables of the order service — now part of the package (:mod:`idemq.chaos.orders`), so that
``idemq chaos`` works once installed; re-exported here for the example's readers and tests."""

from idemq.chaos.orders import (
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
    "OrderTables",
    "create_schema",
    "drop_schema",
    "make_async_engine",
    "make_engine",
    "seed",
]
