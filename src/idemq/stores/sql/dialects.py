"""Each dialect's plans where it has a better native form than the portable
:class:`~idemq.stores.sql.plans.Ops` — above all the claim, one atomic statement on the server
(plus a read when it lost):

==========  ================================================================================
PostgreSQL  ``WITH ins AS (INSERT … ON CONFLICT DO NOTHING|UPDATE … RETURNING …) SELECT …``:
            won or lost, one round trip.
SQLite      ``INSERT … ON CONFLICT``, won iff it changed a row; a lost claim reads the row
            (in-process: a second statement is cheaper than ``RETURNING``).
MariaDB     ``INSERT … ON DUPLICATE KEY UPDATE … RETURNING``: the row comes back either way;
            this claim won iff the returned owner token is ours.
MySQL       ``INSERT IGNORE`` (+ conditional takeover ``UPDATE``) then ``SELECT … FOR SHARE``.
==========  ================================================================================
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Dialect

from idemq.drivers.sql import Plan
from idemq.errors import StoreConflictError
from idemq.stores.base import Claim, ClaimRequest
from idemq.stores.sql.plans import (
    CLAIM_TRIES,
    COLS,
    INSERT_COLS,
    KEY_WHERE,
    SAME_PAYLOAD,
    Ops,
    json_record,
    key_params,
    row_record,
)

__all__ = ["MariaDbOps", "MySqlOps", "PostgresOps", "SqliteOps", "ops_for"]


class PostgresOps(Ops):
    """One round trip per claim, won or lost (see the module table).

    A lost claim reads the record as columns, not as one JSON text as on MySQL: psycopg's binary
    loaders are C, so columns cost less than decoding JSON and parsing its timestamps.
    """

    def __init__(self, table: str, **kw: Any) -> None:
        super().__init__(table, **kw)
        self.sql_claim_read = self.sql_get
        upsert = (
            f"INSERT INTO {table} AS cur ({INSERT_COLS}) VALUES {{values}} "
            "ON CONFLICT (consumer, message_id) DO {action} RETURNING 1"
        )
        takeover = (
            "UPDATE SET owner = EXCLUDED.owner, lease_until_ms = EXCLUDED.lease_until_ms, "
            "attempts = cur.attempts + 1 WHERE cur.status = 0 AND cur.lease_until_ms <= :now_ms "
            + SAME_PAYLOAD.format(cur="cur", new="EXCLUDED")
        )
        # Won: one row (1, NULLs) from the insert. Lost: (0, the record) from the table. (The
        # NULLs take their types from the other branch.)
        nulls = ", NULL" * len(COLS.split(","))
        cte = (
            f"WITH ins AS ({{insert}}) SELECT 1{nulls} FROM ins UNION ALL "
            f"SELECT 0, {COLS} FROM {table} "
            f"WHERE {KEY_WHERE} AND NOT EXISTS (SELECT 1 FROM ins)"
        )
        self.sql_claim = {
            transactional: self.sql(
                cte.format(
                    insert=upsert.format(
                        values=self.VALUES[transactional],
                        action="NOTHING" if transactional else takeover,
                    )
                )
            )
            for transactional in (True, False)
        }

    def size(self) -> Plan:
        # Heap + indexes + TOAST; exact for the relation, includes dead tuples not yet vacuumed.
        sql = self.sql("SELECT pg_total_relation_size(CAST(:name AS regclass))")
        reply = yield sql, {"name": self.table}, True
        return int(reply.rows[0][0]), "pg_total_relation_size (table + indexes + TOAST)"

    def claim(self, request: ClaimRequest, transactional: bool) -> Plan:
        params = self.claim_params(request, transactional)
        for _ in range(CLAIM_TRIES):
            reply = yield self.sql_claim[transactional], params, True
            if reply.rows:
                row = reply.rows[0]
                return Claim.won() if row[0] == 1 else Claim.lost_to(row_record(row[1:]))
            # The conflicting row was committed while we waited for its lock: it is newer than
            # this statement's snapshot. A fresh statement sees it.
            reply = yield self.sql_claim_read, key_params(request.key), True
            if reply.rows:
                return Claim.lost_to(row_record(reply.rows[0]))
        raise StoreConflictError("the record kept vanishing while being claimed")


class SqliteOps(Ops):
    """``INSERT … ON CONFLICT``; its row count says won or lost. SQLite stores DATETIME as text.

    No ``RETURNING`` and no JSON record: SQLite runs in-process, so a second statement costs no
    round trip, and both would cost more CPU than they save (RETURNING buffers its rows in a
    temporary table; columns are free here, unlike PyMySQL's).
    """

    def __init__(self, table: str, **kw: Any) -> None:
        super().__init__(table, **kw)
        upsert = (
            f"INSERT INTO {table} ({INSERT_COLS}) VALUES {{values}} "
            "ON CONFLICT (consumer, message_id) DO {action}"
        )
        takeover = (
            "UPDATE SET owner = excluded.owner, lease_until_ms = excluded.lease_until_ms, "
            f"attempts = {table}.attempts + 1 "
            f"WHERE {table}.status = 0 AND {table}.lease_until_ms <= :now_ms "
            + SAME_PAYLOAD.format(cur=table, new="excluded")
        )
        self.sql_claim = {
            transactional: self.sql(
                upsert.format(
                    values=self.VALUES[transactional],
                    action="NOTHING" if transactional else takeover,
                )
            )
            for transactional in (True, False)
        }

    def size(self) -> Plan:
        probe = "SELECT 1 FROM pragma_compile_options WHERE compile_options = 'ENABLE_DBSTAT_VTAB'"
        if (yield probe, {}, True).rows:
            # Pages of the table and of its indexes (the primary key's autoindex included).
            reply = yield (
                self.sql(
                    "SELECT SUM(pgsize) FROM dbstat WHERE name IN "
                    "(SELECT name FROM sqlite_master WHERE tbl_name = :name)"
                ),
                {"name": self.name},
                True,
            )
            return int(reply.rows[0][0] or 0), "sqlite dbstat (table + indexes)"
        whole_file = "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()"
        reply = yield whole_file, {}, True
        return int(reply.rows[0][0]), "sqlite page_count * page_size (whole database file)"

    def timestamp(self, now_ms: int) -> Any:
        # SQLAlchemy's SQLite DateTime text format, so Core readers parse what we write.
        return super().timestamp(now_ms).isoformat(" ", "microseconds")

    def claim(self, request: ClaimRequest, transactional: bool) -> Plan:
        params = self.claim_params(request, transactional)
        for _ in range(CLAIM_TRIES):
            # 1: inserted, or (lease mode) an expired lease taken over; 0: the row stays another's.
            if (yield self.sql_claim[transactional], params, False).rowcount == 1:
                return Claim.won()
            reply = yield self.sql_get, key_params(request.key), True
            if reply.rows:
                return Claim.lost_to(row_record(reply.rows[0]))
        raise StoreConflictError("the record kept vanishing while being claimed")


class MySqlOps(Ops):
    """MySQL 8: the generic insert-ignore plan with locking reads; LIMIT-ed DELETE for purge."""

    insert_ignore = "INSERT IGNORE INTO {t} ({cols}) VALUES {values}"
    lock_suffix = " LOCK IN SHARE MODE"
    purge_template = (
        "DELETE FROM {t} WHERE status = 1 AND processed_time < :cutoff "
        "ORDER BY processed_time LIMIT :limit"
    )

    def size(self) -> Plan:
        # InnoDB refreshes these statistics lazily (ANALYZE TABLE forces it): approximate.
        sql = self.sql(
            "SELECT data_length + index_length FROM information_schema.tables "
            "WHERE table_schema = COALESCE(:schema, DATABASE()) AND table_name = :name"
        )
        reply = yield sql, {"schema": self.schema, "name": self.name}, True
        value = reply.rows[0][0] if reply.rows else None
        return (
            None if value is None else int(value),
            "information_schema data_length + index_length (approximate)",
        )


class MariaDbOps(MySqlOps):
    """MariaDB ≥ 10.5: ``INSERT … ON DUPLICATE KEY UPDATE … RETURNING`` claims in one statement."""

    def __init__(self, table: str, **kw: Any) -> None:
        super().__init__(table, **kw)
        upsert = f"INSERT INTO {table} ({INSERT_COLS}) VALUES {{}} ON DUPLICATE KEY UPDATE "
        # Assignments run left to right and see earlier ones: owner changes first, and only
        # when the lease expired; the other columns follow the owner, so the takeover is all or
        # nothing within one row lock.
        takeover = (
            "owner = IF(status = 0 AND lease_until_ms <= :now_ms AND (payload_hash IS NULL OR "
            "VALUES(payload_hash) IS NULL OR payload_hash = VALUES(payload_hash)), "
            "VALUES(owner), owner), "
            "attempts = IF(owner = VALUES(owner), attempts + 1, attempts), "
            "lease_until_ms = IF(owner = VALUES(owner), VALUES(lease_until_ms), lease_until_ms)"
        )
        returning = f" RETURNING owner, {self.record_json}"
        self.sql_claim = {
            True: self.sql(upsert.format(self.VALUES[True]) + "attempts = attempts" + returning),
            False: self.sql(upsert.format(self.VALUES[False]) + takeover + returning),
        }

    def claim(self, request: ClaimRequest, transactional: bool) -> Plan:
        reply = yield (
            self.sql_claim[transactional],
            self.claim_params(request, transactional),
            True,
        )
        owner, record = reply.rows[0]
        if owner == request.owner:
            return Claim.won()
        return Claim.lost_to(json_record(request.key, record))


def ops_for(
    dialect: Dialect,
    table: str,
    *,
    mysql_flavor: str | None = None,
    name: str | None = None,
    schema: str | None = None,
) -> Ops:
    """The plans for ``dialect``; ``mysql_flavor`` ("mysql"/"mariadb") overrides detection.

    ``table`` is the quoted name used in statements; ``name``/``schema`` the unquoted parts,
    for catalog lookups."""
    pyformat = dialect.paramstyle in ("pyformat", "format")
    kw: dict[str, Any] = {"pyformat": pyformat, "name": name, "schema": schema}
    if dialect.name == "postgresql":
        return PostgresOps(table, **kw)
    if dialect.name == "sqlite":
        return SqliteOps(table, **kw)
    if dialect.name in ("mysql", "mariadb"):
        flavor = mysql_flavor or ("mariadb" if getattr(dialect, "is_mariadb", False) else "mysql")
        cls = MariaDbOps if flavor == "mariadb" else MySqlOps
        return cls(table, **kw)
    return Ops(table, **kw)
