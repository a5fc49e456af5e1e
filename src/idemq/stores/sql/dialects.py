"""Each dialect's claim: one atomic statement on the server (plus a read when it lost).

==========  ================================================================================
PostgreSQL  ``WITH ins AS (INSERT … ON CONFLICT DO NOTHING RETURNING 1) SELECT …``: won or
            lost, one round trip that writes nothing for a duplicate; an expired lease is then
            taken over by a conditional ``UPDATE`` (a second round trip, takeovers only).
SQLite      ``INSERT … ON CONFLICT``, won iff it changed a row; a lost claim reads the row
            (in-process: a second statement costs no round trip).
MariaDB     ``INSERT … ON DUPLICATE KEY UPDATE … RETURNING``: the row comes back either way;
            this claim won iff the returned owner token is ours.
MySQL       ``INSERT IGNORE`` (+ conditional takeover ``UPDATE``) then ``SELECT … FOR SHARE``.
==========  ================================================================================

The upserts are SQLAlchemy's dialect constructs (``postgresql.insert().on_conflict_do_update``,
``sqlite.insert()``, ``mysql.insert().on_duplicate_key_update``); the rest of each statement is
Core built around them.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    DateTime,
    Dialect,
    Insert,
    Integer,
    Select,
    String,
    Table,
    and_,
    bindparam,
    case,
    cast,
    exists,
    extract,
    func,
    insert,
    literal_column,
    null,
    select,
    text,
    update,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite

from idemq._clock import process_fence_us
from idemq.drivers.sql import DriverStatement, Plan, Step
from idemq.errors import ConfigurationError, StoreConflictError
from idemq.stores.base import Claim, ClaimRequest
from idemq.stores.sql.plans import (
    CLAIM_TRIES,
    PROCESSED,
    PROCESSING,
    PlanOptions,
    SqlPlans,
    StatementClock,
    constant,
    json_record,
    key_params,
    new_row,
    record_json,
    row_record,
    same_payload,
)
from idemq.stores.sql.schema import UtcDateTime

__all__ = ["MariaDbPlans", "MySqlPlans", "PostgresPlans", "SqlitePlans", "plans_for"]

KEY = ["consumer", "message_id"]  # the primary key: the conflict every claim arbitrates on


def on_conflict(row: Any, transactional: bool, clock: StatementClock) -> Any:
    """The ``ON CONFLICT`` of SQLite's claim insert ``row`` (PostgreSQL's claim inserts with
    ``DO NOTHING`` and takes an expired lease over apart: see :class:`PostgresPlans`).

    In the business transaction an existing row stays as it is. In lease mode an expired lease
    is taken over, by the same message only; the owner, its lease and the attempt count change
    together.
    """
    if transactional:
        return row.on_conflict_do_nothing(index_elements=KEY)
    current = row.table.c
    return row.on_conflict_do_update(
        index_elements=KEY,
        set_={
            "owner": row.excluded.owner,
            "lease_until_ms": row.excluded.lease_until_ms,
            "attempts": current.attempts + constant(1),
        },
        where=and_(
            current.status == constant(PROCESSING),
            current.lease_until_ms <= clock.now_ms(),
            same_payload(current.payload_hash, row.excluded.payload_hash),
        ),
    )


class PostgresPlans(SqlPlans):
    """One round trip per claim, won or lost; a takeover adds a conditional UPDATE.

    The claim's insert is ``ON CONFLICT DO NOTHING`` in both modes: a duplicate that finds a
    completed record or a live lease locks nothing and writes nothing (no transaction id, no
    WAL), unlike ``ON CONFLICT DO UPDATE … WHERE``, which locks the conflicting row even when
    its WHERE is false. The read reports whether the record is an expired lease this message
    may take over; only then does ``UPDATE … WHERE <still expired>`` take it, atomically (a
    racing takeover re-checks the WHERE on the row it waited for, and finds it taken).
    """

    def __init__(self, table: Table, dialect: Dialect, options: PlanOptions | None = None) -> None:
        super().__init__(table, dialect, options)
        self.claim_stmt = {tx: self.driver(self._claim_statement(tx)) for tx in (True, False)}
        c = table.c
        self.takeover_stmt = self.driver(
            update(table)
            .where(self.key_is, self._takeover_allowed())
            .values(
                owner=bindparam("b_owner"),
                lease_until_ms=self.clock.lease_until(),
                attempts=c.attempts + constant(1),
            )
            .returning(self.fence_us.label("fence"))
        )
        relation = cast(bindparam("b_name", type_=String), postgresql.REGCLASS)
        self.size_stmt = select(func.pg_total_relation_size(relation))
        # A batch of expired rows read off ix_status_time in its order (without the ORDER BY
        # the planner may take a LIMITed sequential scan, which reads the whole table when few
        # rows are left to find) and deleted by their tuple ids, with no primary-key probe per
        # row. The outer conditions are checked again on the row as it is when the DELETE
        # reaches it, so a row that changed meanwhile (taken again after an expiry) stays.
        quoted = dialect.identifier_preparer.format_table(table)
        expired = f"status = {PROCESSED} AND processed_time < :b_cutoff"
        self.purge_stmt = text(
            f"DELETE FROM {quoted} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {quoted} WHERE"
            f" {expired} ORDER BY processed_time LIMIT :b_limit)) AND {expired}"
        ).bindparams(
            bindparam("b_cutoff", type_=UtcDateTime()), bindparam("b_limit", type_=Integer())
        )

    @property
    def fence_us(self) -> ColumnElement[int]:
        """The server's clock in epoch microseconds: a won claim's fence."""
        epoch = extract("epoch", func.statement_timestamp())
        return cast(func.floor(epoch * 1_000_000), BigInteger)

    def server_clock(self) -> StatementClock:
        # statement_timestamp(): the time the statement started, one value for all of it (now()
        # is the transaction's start; clock_timestamp() changes within a statement).
        started = func.statement_timestamp()
        epoch_ms = cast(func.floor(extract("epoch", started) * 1000), BigInteger)
        return StatementClock(epoch_ms, func.timezone("UTC", started, type_=DateTime()))

    def insert_ignore(self, rows: list[dict[str, Any]]) -> Insert:
        return postgresql.insert(self.table).values(rows).on_conflict_do_nothing(index_elements=KEY)

    def _takeover_allowed(self) -> ColumnElement[bool]:
        """The record is a lease that is over, claimed for the same message."""
        c = self.table.c
        return and_(
            c.status == constant(PROCESSING),
            c.lease_until_ms <= self.clock.now_ms(),
            same_payload(c.payload_hash, bindparam("b_payload_hash", type_=String())),
        )

    def _claim_statement(self, transactional: bool) -> Any:
        row = postgresql.insert(self.table).values(new_row(transactional, clock=self.clock))
        inserted = (
            row.on_conflict_do_nothing(index_elements=KEY)
            .returning(constant(1).label("one"))
            .cte("ins")
        )
        # Lost: (0, the record, no fence, may it be taken over) from the table. Won: one row
        # (1, NULL, the fence, NULL) from the insert. The lost branch comes first: its columns
        # give the result its types.
        record = record_json(self.table, func.json_build_array)
        no_fence = cast(null(), BigInteger).label("fence")
        expired = (
            constant(0) if transactional else case((self._takeover_allowed(), 1), else_=0)
        ).label("expired")
        lost = select(constant(0).label("won"), record, no_fence, expired).where(
            self.key_is, ~exists(inserted.select())
        )
        won = select(constant(1), null(), self.fence_us, null()).select_from(inserted)
        return lost.union_all(won)

    def claim(self, request: ClaimRequest, transactional: bool) -> Plan[Claim]:
        params = self.claim_params(request, transactional)
        for _ in range(CLAIM_TRIES):
            reply = yield Step(self.claim_stmt[transactional], params)
            if reply.rows:
                row = reply.rows[0]
                if row.won == 1:
                    return Claim.won(row.fence)
                if row.expired != 1:
                    return Claim.lost_to(json_record(request.key, row.record))
                taken = yield Step(self.takeover_stmt, params)
                if taken.rows:
                    return Claim.won(taken.rows[0].fence)
            # The conflicting row was committed while we waited for its lock (it is newer than
            # this statement's snapshot), or another claim took the expired lease first: a
            # fresh statement sees the record as it is now.
            reply = yield Step(self.get_stmt, key_params(request.key))
            if reply.rows:
                return Claim.lost_to(row_record(reply.rows[0]))
        raise StoreConflictError("the record kept vanishing while being claimed")

    def size(self) -> Plan[tuple[int | None, str]]:
        # Heap + indexes + TOAST; exact for the relation, includes dead tuples not yet vacuumed.
        name = self.dialect.identifier_preparer.format_table(self.table)
        reply = yield Step(self.size_stmt, {"b_name": name})
        return int(reply.rows[0][0]), "pg_total_relation_size (table + indexes + TOAST)"


class SqlitePlans(SqlPlans):
    """``INSERT … ON CONFLICT``; its row count says won or lost.

    No ``RETURNING``: SQLite runs in-process, so the read after a lost claim costs no round trip,
    and ``RETURNING`` would buffer its rows in a temporary table for every claim.
    """

    _has_dbstat = text(
        "SELECT 1 FROM pragma_compile_options WHERE compile_options = 'ENABLE_DBSTAT_VTAB'"
    )
    # Pages of the table and of its indexes (the primary key's autoindex included).
    _dbstat_size = text(
        "SELECT SUM(pgsize) FROM dbstat WHERE name IN "
        "(SELECT name FROM sqlite_master WHERE tbl_name = :b_name)"
    )
    _file_size = text("SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()")

    def __init__(self, table: Table, dialect: Dialect, options: PlanOptions | None = None) -> None:
        super().__init__(table, dialect, options)
        self.claim_stmt = {
            tx: self.driver(on_conflict(sqlite.insert(table).values(new_row(tx)), tx, self.clock))
            for tx in (True, False)
        }

    def insert_ignore(self, rows: list[dict[str, Any]]) -> Insert:
        return sqlite.insert(self.table).values(rows).on_conflict_do_nothing(index_elements=KEY)

    def claim(self, request: ClaimRequest, transactional: bool) -> Plan[Claim]:
        params = self.claim_params(request, transactional)
        for _ in range(CLAIM_TRIES):
            # 1: inserted, or (lease mode) an expired lease taken over; 0: the row stays another's.
            if (yield Step(self.claim_stmt[transactional], params)).rowcount == 1:
                return Claim.won(process_fence_us())  # in-process: SQLite's clock is ours
            reply = yield Step(self.get_stmt, key_params(request.key))
            if reply.rows:
                return Claim.lost_to(row_record(reply.rows[0]))
        raise StoreConflictError("the record kept vanishing while being claimed")

    def size(self) -> Plan[tuple[int | None, str]]:
        if (yield Step(self._has_dbstat, {})).rows:
            reply = yield Step(self._dbstat_size, {"b_name": self.table.name})
            return int(reply.rows[0][0] or 0), "sqlite dbstat (table + indexes)"
        reply = yield Step(self._file_size, {})
        return int(reply.rows[0][0]), "sqlite page_count * page_size (whole database file)"


class MySqlPlans(SqlPlans):
    """MySQL 8: insert-ignore, a conditional takeover, then a locking read of the winner."""

    # InnoDB refreshes these statistics lazily (ANALYZE TABLE forces it): approximate.
    _size = text(
        "SELECT data_length + index_length FROM information_schema.tables "
        "WHERE table_schema = COALESCE(:b_schema, DATABASE()) AND table_name = :b_name"
    )

    def __init__(self, table: Table, dialect: Dialect, options: PlanOptions | None = None) -> None:
        super().__init__(table, dialect, options)
        c = table.c
        clock = self.clock
        # A locking read sees the latest committed row, not this transaction's snapshot.
        self.claim_read_stmt = self.driver(
            select(record_json(table, func.json_array))
            .where(self.key_is)
            .with_for_update(read=True)
        )
        self.claim_stmt = {
            tx: self.driver(self.insert_ignore([new_row(tx, clock=clock)])) for tx in (True, False)
        }
        self.fence_stmt = self.driver(select(self.fence_us))
        self.takeover_stmt = self.driver(
            update(table)
            .where(
                self.key_is,
                c.status == constant(PROCESSING),
                c.lease_until_ms <= clock.now_ms(),
                same_payload(c.payload_hash, bindparam("b_payload_hash")),
            )
            .values(
                owner=bindparam("b_owner"),
                lease_until_ms=clock.lease_until(),
                attempts=c.attempts + constant(1),
            )
        )
        # MySQL refuses LIMIT in an IN subquery, and DELETE … ORDER BY … LIMIT has no Core form.
        quoted = dialect.identifier_preparer.format_table(table)
        self.purge_stmt = text(
            f"DELETE FROM {quoted} WHERE status = {PROCESSED} AND processed_time < :b_cutoff "
            "ORDER BY processed_time LIMIT :b_limit"
        ).bindparams(
            bindparam("b_cutoff", type_=UtcDateTime()), bindparam("b_limit", type_=Integer())
        )

    def batch_read(self) -> Select[Any]:
        # A locking read sees the latest committed rows, not this transaction's snapshot.
        return super().batch_read().with_for_update(read=True)

    def server_clock(self) -> StatementClock:
        # UTC_TIMESTAMP(6): the statement's start in UTC, free of the session's time zone (and of
        # its daylight-saving overlaps, which UNIX_TIMESTAMP(NOW()) would have to resolve).
        return StatementClock(
            literal_column(
                "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)",
                BigInteger(),
            ),
            literal_column("UTC_TIMESTAMP(6)", DateTime()),
        )

    @property
    def fence_us(self) -> ColumnElement[int]:
        """The server's clock in epoch microseconds: a won claim's fence."""
        return literal_column(
            "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))", BigInteger()
        ).label("fence")

    def _won(self, transactional: bool) -> Plan[Claim]:
        """A won claim; in lease mode with its fence, read from the server (the one claim plan
        whose insert returns nothing: a statement more, on MySQL 8's portable path only)."""
        if transactional:
            return Claim.won()
        return Claim.won((yield Step(self.fence_stmt, {})).rows[0].fence)

    def insert_ignore(self, rows: list[dict[str, Any]]) -> Insert:
        return insert(self.table).values(rows).prefix_with("IGNORE")

    def claim(self, request: ClaimRequest, transactional: bool) -> Plan[Claim]:
        params = self.claim_params(request, transactional)
        for _ in range(CLAIM_TRIES):
            if (yield Step(self.claim_stmt[transactional], params)).rowcount == 1:
                return (yield from self._won(transactional))
            if not transactional and (yield Step(self.takeover_stmt, params)).rowcount == 1:
                return (yield from self._won(transactional))
            reply = yield Step(self.claim_read_stmt, key_params(request.key))
            if reply.rows:
                return Claim.lost_to(json_record(request.key, reply.rows[0].record))
        raise StoreConflictError("the record kept vanishing while being claimed")

    def size(self) -> Plan[tuple[int | None, str]]:
        reply = yield Step(self._size, {"b_schema": self.table.schema, "b_name": self.table.name})
        value = reply.rows[0][0] if reply.rows else None
        return (
            None if value is None else int(value),
            "information_schema data_length + index_length (approximate)",
        )


class MariaDbPlans(MySqlPlans):
    """MariaDB ≥ 10.5: ``INSERT … ON DUPLICATE KEY UPDATE … RETURNING`` claims in one statement."""

    def __init__(self, table: Table, dialect: Dialect, options: PlanOptions | None = None) -> None:
        super().__init__(table, dialect, options)
        c = table.c
        claim_stmt: dict[bool, DriverStatement] = {}
        for transactional in (True, False):
            row = mysql.insert(table).values(new_row(transactional, clock=self.clock))
            new = row.inserted
            if transactional:  # a no-op update, so that RETURNING hands back the existing row
                upsert = row.on_duplicate_key_update(attempts=c.attempts)
            else:
                # Assignments run left to right and see earlier ones: the owner changes first,
                # and only when the lease expired; the other columns follow the owner, so the
                # takeover is all or nothing within one row lock.
                expired = and_(
                    c.status == constant(PROCESSING),
                    c.lease_until_ms <= self.clock.now_ms(),
                    same_payload(c.payload_hash, new.payload_hash),
                )
                taken = c.owner == new.owner
                upsert = row.on_duplicate_key_update(
                    [
                        ("owner", func.IF(expired, new.owner, c.owner)),
                        ("attempts", func.IF(taken, c.attempts + constant(1), c.attempts)),
                        ("lease_until_ms", func.IF(taken, new.lease_until_ms, c.lease_until_ms)),
                    ]
                )
            record = record_json(table, func.json_array)
            claim_stmt[transactional] = self.driver(
                upsert.returning(c.owner, record, self.fence_us)
            )
        self.claim_stmt = claim_stmt

    def claim(self, request: ClaimRequest, transactional: bool) -> Plan[Claim]:
        params = self.claim_params(request, transactional)
        row = (yield Step(self.claim_stmt[transactional], params)).rows[0]
        if row.owner == request.owner:
            return Claim.won(row.fence)
        return Claim.lost_to(json_record(request.key, row.record))


def plans_for(
    dialect: Dialect,
    table: Table,
    *,
    mysql_flavor: str | None = None,
    options: PlanOptions | None = None,
) -> SqlPlans:
    """The plans for ``table`` on ``dialect``; ``mysql_flavor`` ("mysql"/"mariadb") overrides
    detection (known once a connection saw the server); ``options``: see :class:`PlanOptions`."""
    if dialect.name == "postgresql":
        return PostgresPlans(table, dialect, options)
    if dialect.name == "sqlite":
        return SqlitePlans(table, dialect, options)
    if dialect.name in ("mysql", "mariadb"):
        flavor = mysql_flavor or ("mariadb" if getattr(dialect, "is_mariadb", False) else "mysql")
        cls = MariaDbPlans if flavor == "mariadb" else MySqlPlans
        return cls(table, dialect, options)
    raise ConfigurationError(
        f"the SQL store runs on PostgreSQL, SQLite, MariaDB and MySQL, not {dialect.name!r}"
    )
