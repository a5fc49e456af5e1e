"""Handlers of the order service: dedup guard + state machine + debit, in one transaction.

The logic lives in :mod:`idemq.chaos.orders` (the chaos runner drives the same service); this
module adds the module-level handler for the command line::

    idemq worker examples.orders.handlers:handle --broker … --store …

(tables prefixed by ``$IDEMQ_ORDERS_PREFIX``, default none).
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy.engine import Connection

from idemq.chaos.orders import (
    InsufficientFundsError,
    MessageLike,
    OrderService,
    RetryLaterError,
    order_machine,
    parse_body,
)

__all__ = [
    "InsufficientFundsError",
    "MessageLike",
    "OrderService",
    "RetryLaterError",
    "handle",
    "order_machine",
    "parse_body",
]

_DEFAULT = OrderService(prefix=os.environ.get("IDEMQ_ORDERS_PREFIX", ""))


def handle(msg: MessageLike, tx: Connection) -> dict[str, Any]:
    """The module-level handler for ``idemq worker examples.orders.handlers:handle``."""
    return _DEFAULT.handle(msg, tx)
