"""The transactional outbox: messages written in the business transaction, relayed after it.

``Outbox.add(tx, destination, body)`` writes a row beside the business change; an
:class:`OutboxRelay` (``idemq relay``, or ``idemq worker --relay``) publishes committed rows
with publisher confirms and forgets each only after its confirm. With the inbox (the dedup row
of the consuming side) a consume → change → publish chain has its effects exactly once.
"""

from idemq.outbox.admin import OutboxStats, cleanup, outbox_report, outbox_stats, retry_dead
from idemq.outbox.outbox import AsyncOutbox, Outbox
from idemq.outbox.relay import BatchResult, OutboxRelay
from idemq.outbox.schema import DEFAULT_TABLE, ddl, outbox_sql

__all__ = [
    "DEFAULT_TABLE",
    "AsyncOutbox",
    "BatchResult",
    "Outbox",
    "OutboxRelay",
    "OutboxStats",
    "cleanup",
    "ddl",
    "outbox_report",
    "outbox_sql",
    "outbox_stats",
    "retry_dead",
]
