"""What operators and tools read or do to an outbox: stats, cleanup of sent rows, retry of a
dead row (``idemq stats``, the metrics, ``idemq outbox retry``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import inspect

from idemq.drivers.sql import translated
from idemq.errors import DuplicateKeyError, InvalidInputError
from idemq.outbox.outbox import Outbox

__all__ = ["OutboxStats", "cleanup", "outbox_report", "outbox_stats", "retry_dead"]


@dataclass(frozen=True, slots=True)
class OutboxStats:
    """What ``idemq stats`` and the metrics show of an outbox."""

    pending: int
    oldest_pending_age_s: float
    dead: int


def cleanup(
    outbox: Outbox, *, keep_sent_s: float, batch: int = 1000, now_ms: int | None = None
) -> int:
    """Delete rows of ``outbox`` sent more than ``keep_sent_s`` ago, ``batch`` per transaction
    (no long lock, an indexed range each time); how many went."""
    now = outbox.clock() if now_ms is None else now_ms
    cutoff = now - int(keep_sent_s * 1000)
    total = 0
    while True:
        with translated(f"cleanup of {outbox.table}"), outbox.engine.begin() as conn:
            sql = outbox.statements(conn.dialect)
            deleted = conn.execute(sql.cleanup, {"cutoff_ms": cutoff, "limit": batch}).rowcount
        total += deleted
        if deleted < batch:
            return total


def outbox_stats(outbox: Outbox, *, now_ms: int | None = None) -> OutboxStats:
    """Pending rows, the age of the oldest one, dead rows."""
    now = outbox.clock() if now_ms is None else now_ms
    with translated(f"stats of {outbox.table}"), outbox.engine.connect() as conn:
        sql = outbox.statements(conn.dialect)
        pending, oldest = conn.execute(sql.stats).one()
        dead = conn.execute(sql.dead_count).scalar_one()
    age_s = max(0.0, (now - int(oldest)) / 1000) if oldest is not None else 0.0
    return OutboxStats(pending=int(pending), oldest_pending_age_s=age_s, dead=int(dead))


def retry_dead(outbox: Outbox, message_id: str) -> bool:
    """Move the dead row ``message_id`` back into the outbox (a fresh ``seq``, 0 attempts);
    ``False`` if there is no such dead row."""
    now = outbox.clock()
    try:
        with (
            translated(f"retry of {message_id!r} in {outbox.table}"),
            outbox.engine.begin() as conn,
        ):
            sql = outbox.statements(conn.dialect)
            row = conn.execute(sql.from_dead, {"id": message_id}).one_or_none()
            if row is None:
                return False
            insert = sql.insert if row.ordering_key is None else sql.insert_keyed
            params = {
                "id": row.id,
                "destination": row.destination,
                "body": bytes(row.body),
                "headers": row.headers,
                "ordering_key": row.ordering_key,
                "now_ms": now,
                "channel": sql.channel,
            }
            # The insert adds nothing for an id already waiting (a later run of the message
            # took it again after a forget): the dead row is then kept, not dropped unsent.
            if conn.execute(insert.statement, params).rowcount != 1:
                raise _already_waiting(outbox, message_id)
            conn.execute(sql.delete_dead, {"id": message_id})
            return True
    except DuplicateKeyError as exc:
        raise _already_waiting(outbox, message_id) from exc


def _already_waiting(outbox: Outbox, message_id: str) -> InvalidInputError:
    return InvalidInputError(
        f"{message_id!r} is dead and also waiting (or kept) in {outbox.table}: not moved back"
    )


def outbox_report(store: Any, table: str) -> dict[str, Any] | None:
    """The ``outbox`` section of ``idemq stats`` (JSON-ready), or ``None`` when ``store`` is not
    a SQL store or its database has no such outbox table."""
    engine = getattr(store, "engine", None)
    if engine is None or not hasattr(engine, "connect"):
        return None
    outbox = Outbox(store, table=table)
    with translated(f"stats of {table}"):
        if not inspect(engine).has_table(table):
            return None
    stats = outbox_stats(outbox)
    return {
        "table": table,
        "pending": stats.pending,
        "oldest_pending_age_s": round(stats.oldest_pending_age_s, 3),
        "dead": stats.dead,
    }
