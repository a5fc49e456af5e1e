"""The outbox's SQL, per dialect, built once per table: what ``add`` and the relay run.

Every statement is a ``text()`` with bound parameters; only the (checked) table names are
spliced in, quoted by the dialect. The ones run for every message (``add``'s insert and id
check, the relay's claim and its settling delete or mark) are compiled once for the dialect
(:class:`~idemq.drivers.sql.DriverStatement`) and run on the driver's cursor.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Dialect, TextClause, bindparam, text

from idemq.drivers.sql import DriverStatement

__all__ = ["LOCK_SPACE", "Statements", "statements_for"]

# The first half of PostgreSQL's two-int advisory lock key: keeps our per-ordering-key locks
# apart from advisory locks the application takes for itself.
LOCK_SPACE = 0x1DE3


@dataclass(frozen=True)
class Statements:
    """The statements of one outbox table on one dialect."""

    dialect: str
    channel: str  # PostgreSQL LISTEN/NOTIFY channel ('' elsewhere)
    insert: DriverStatement
    insert_keyed: DriverStatement  # the same, for a row with an ordering key
    has_id: DriverStatement  # is a row with this id pending, kept or dead?
    claim: DriverStatement
    delete_sent: DriverStatement
    mark_sent: DriverStatement
    fail: TextClause
    to_dead: TextClause
    delete_one: TextClause
    from_dead: TextClause
    delete_dead: TextClause
    cleanup: TextClause
    stats: TextClause
    dead_count: TextClause
    lease: bool  # SQLite: claims are leases on the rows, not row locks
    # SQLite only (None elsewhere): extend this relay's leases on :ids, returning the ids it
    # still holds (the fence before a publish), and delete only the rows it still holds.
    renew_leases: TextClause | None = None
    delete_leased: DriverStatement | None = None
    release_leases: TextClause | None = None  # rows a batch did not get to (an outage)
    lease_of: TextClause | None = None  # who holds a row's lease, until when


_COLUMNS = "id, destination, body, headers, ordering_key, created_ms, attempts, next_attempt_ms"
_VALUES = ":id, :destination, :body, :headers, :ordering_key, :now_ms, 0, :now_ms"

# A row is due when nothing earlier of its key is still unsent: that is what keeps a key's rows
# in seq order across relays (each sees the earlier row until its deletion commits).
_HEAD = (
    "(o.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {t} p WHERE p.ordering_key ="
    " o.ordering_key AND p.sent_ms IS NULL AND p.seq < o.seq))"
)
_IF_NEW = "ON CONFLICT (id) DO NOTHING"
_PICK = "o.sent_ms IS NULL AND o.next_attempt_ms <= :now_ms AND " + _HEAD


def statements_for(dialect: Dialect, table: str) -> Statements:
    """The statements for ``table`` (already checked by ``check_table_name``) on ``dialect``."""
    quote = dialect.identifier_preparer.quote
    t, dead = quote(table), quote(f"{table}_dead")
    name = dialect.name
    pick = _PICK.format(t=t)
    # Every picked row has sent_ms NULL, so both are seq order. PostgreSQL does not take
    # ``sent_ms IS NULL`` as fixing the index's first column; spelled as ix_pending's columns,
    # its index scan delivers rows in order and the LIMIT stops it: a backlog is never sorted.
    order = "ORDER BY o.sent_ms, o.seq" if name == "postgresql" else "ORDER BY o.seq"
    channel = ""
    if name == "postgresql":
        channel = table
        # One statement: the NOTIFY (sent at commit, so a relay never wakes before the row is
        # visible) and, for a keyed row, a lock on the key held to commit, so two transactions
        # adding rows of one key take seq numbers in the order they commit.
        # ON CONFLICT DO NOTHING: an id already there adds no row (rowcount 0) and, unlike a
        # duplicate-key error, leaves the caller's transaction usable; a racing add of the same
        # id waits for the first one's commit, then adds nothing.
        insert = text(
            f"INSERT INTO {t} ({_COLUMNS}) SELECT {_VALUES} FROM (SELECT pg_notify(:channel, ''))"
            f" AS n {_IF_NEW}"
        )
        insert_keyed = text(
            f"INSERT INTO {t} ({_COLUMNS}) SELECT {_VALUES} FROM (SELECT pg_notify(:channel, ''),"
            f" pg_advisory_xact_lock({LOCK_SPACE}, hashtext(:ordering_key))) AS n {_IF_NEW}"
        )
    elif name == "sqlite":
        # One writer at a time on SQLite: MAX(seq) + 1 is taken under the write lock. (WHERE
        # true: SQLite's grammar needs it before the ON CONFLICT of an INSERT … SELECT.)
        insert = insert_keyed = text(
            f"INSERT INTO {t} ({_COLUMNS}, seq) SELECT {_VALUES}, COALESCE(MAX(seq), 0) + 1"
            f" FROM {t} WHERE true {_IF_NEW}"
        )
    else:
        # A duplicate id fails with 1062, which rolls back only that statement on InnoDB: the
        # add turns it into "already there" (see outbox.add).
        insert = insert_keyed = text(f"INSERT INTO {t} ({_COLUMNS}) VALUES ({_VALUES})")
    returned = "o.id, o.seq, o.destination, o.body, o.headers, o.ordering_key, o.attempts"
    if name == "sqlite":
        claim = text(
            f"UPDATE {t} SET lease_owner = :owner, lease_until_ms = :until_ms WHERE id IN"
            f" (SELECT o.id FROM {t} o WHERE {pick} AND (o.lease_until_ms IS NULL OR"
            f" o.lease_until_ms < :now_ms) {order} LIMIT :limit)"
            " RETURNING id, seq, destination, body, headers, ordering_key, attempts"
        )
        mine = " AND lease_owner = :owner"
        # Owner, not expiry, is the fence: a lease that ran out but was taken by nobody is
        # still this relay's, and SQLite's single writer orders this UPDATE against a rival's
        # claim, so exactly one of them gets the row.
        renew_leases: TextClause | None = text(
            f"UPDATE {t} SET lease_until_ms = :until_ms WHERE id IN :ids{mine} RETURNING id"
        ).bindparams(bindparam("ids", expanding=True))
        delete_leased: TextClause | None = text(
            f"DELETE FROM {t} WHERE id IN :ids{mine}"
        ).bindparams(bindparam("ids", expanding=True))
        lease_of: TextClause | None = text(
            f"SELECT lease_owner, lease_until_ms FROM {t} WHERE id = :id"
        )
        release_leases: TextClause | None = text(
            f"UPDATE {t} SET lease_owner = NULL, lease_until_ms = NULL WHERE id IN :ids{mine}"
        ).bindparams(bindparam("ids", expanding=True))
    else:
        claim = text(
            f"SELECT {returned} FROM {t} o WHERE {pick} {order} LIMIT :limit FOR UPDATE SKIP LOCKED"
        )
        mine = ""
        renew_leases = delete_leased = release_leases = lease_of = None
    if name in ("mysql", "mariadb"):
        # MySQL's own bounded DELETE: a range on ix_pending (an IN-subquery may scan the table).
        cleanup = text(f"DELETE FROM {t} WHERE sent_ms < :cutoff_ms ORDER BY sent_ms LIMIT :limit")
    else:
        cleanup = text(
            f"DELETE FROM {t} WHERE id IN (SELECT id FROM (SELECT id FROM {t} WHERE sent_ms <"
            " :cutoff_ms ORDER BY sent_ms LIMIT :limit) AS c)"
        )
    dead_columns = "id, destination, body, headers, ordering_key, created_ms, attempts, last_error"

    def compiled(statement: TextClause) -> DriverStatement:
        return DriverStatement(statement, dialect)

    return Statements(
        dialect=name,
        channel=channel,
        insert=compiled(insert),
        insert_keyed=compiled(insert_keyed),
        has_id=compiled(
            text(f"SELECT 1 FROM {t} WHERE id = :id UNION ALL SELECT 1 FROM {dead} WHERE id = :id")
        ),
        claim=compiled(claim),
        delete_sent=compiled(
            text(f"DELETE FROM {t} WHERE id IN :ids").bindparams(bindparam("ids", expanding=True))
        ),
        mark_sent=compiled(
            text(
                f"UPDATE {t} SET sent_ms = :now_ms, lease_owner = NULL, lease_until_ms = NULL"
                f" WHERE id IN :ids{mine}"
            ).bindparams(bindparam("ids", expanding=True))
        ),
        fail=text(
            f"UPDATE {t} SET attempts = attempts + :counted, next_attempt_ms = :next_ms,"
            f" last_error = :error, lease_owner = NULL, lease_until_ms = NULL WHERE id = :id{mine}"
        ),
        to_dead=text(
            f"INSERT INTO {dead} ({dead_columns}, dead_ms) SELECT id, destination, body,"
            " headers, ordering_key, created_ms, attempts + 1, :error, :now_ms"
            f" FROM {t} WHERE id = :id{mine}"
        ),
        delete_one=text(f"DELETE FROM {t} WHERE id = :id"),
        from_dead=text(
            f"SELECT id, destination, body, headers, ordering_key FROM {dead} WHERE id = :id"
        ),
        delete_dead=text(f"DELETE FROM {dead} WHERE id = :id"),
        cleanup=cleanup,
        stats=text(f"SELECT COUNT(*), MIN(created_ms) FROM {t} WHERE sent_ms IS NULL"),
        dead_count=text(f"SELECT COUNT(*) FROM {dead}"),
        lease=name == "sqlite",
        renew_leases=renew_leases,
        delete_leased=None if delete_leased is None else compiled(delete_leased),
        release_leases=release_leases,
        lease_of=lease_of,
    )
