"""The SQL of every store primitive, written once as sans-I/O plans: the portable part.

A plan (:data:`idemq.drivers.sql.Plan`) yields :class:`~idemq.drivers.sql.Step`\\ s (a statement
built once per store, and this call's parameters) and receives each step's reply; its return
value is the primitive's answer. :class:`~idemq.stores.sql.SqlStore` carries plans out on a sync
connection and :class:`~idemq.stores.sql.AsyncSqlStore` on an async one, so the two cannot drift
apart.

The statements run for every message (the claims, confirm, complete, release, renew, forget and
the reads a lost claim needs) are :class:`~idemq.drivers.sql.DriverStatement`\\ s: compiled once
here, by SQLAlchemy's compiler for the store's dialect, and run on the driver's cursor. Their rows
hold the driver's values, so what reads them decodes text the driver leaves as text
(:func:`json_record`, :func:`row_record`). The rest stay Core statements.

Bind parameters are named ``b_<what>``, never like a column: ``Connection.execute`` turns a
parameter named like a column into one more ``SET`` (or ``VALUES``) entry of an UPDATE (INSERT),
so a parameter called ``owner`` would silently rewrite the owner of a row it only meant to match.

What differs per dialect (the claim, above all) is in :mod:`idemq.stores.sql.dialects`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    ColumnElement,
    Dialect,
    Insert,
    Integer,
    Label,
    Row,
    Select,
    Table,
    Text,
    and_,
    bindparam,
    case,
    delete,
    func,
    literal_column,
    null,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.sql.expression import ColumnClause

from idemq.drivers.sql import DriverStatement, Plan, Step
from idemq.errors import (
    ConfigurationError,
    LeaseLostError,
    StoreConflictError,
    TransactionLostError,
)
from idemq.stores.base import (
    MILLISECOND,
    Claim,
    ClaimRequest,
    ForgetResult,
    Key,
    Record,
    RecordStatus,
    StoreStats,
)
from idemq.stores.sql.schema import UtcDateTime, as_utc

__all__ = [
    "CLAIM_TRIES",
    "PlanOptions",
    "StatementClock",
    "PROCESSED",
    "PROCESSING",
    "SqlPlans",
    "constant",
    "json_record",
    "key_params",
    "new_row",
    "record_columns",
    "record_json",
    "row_record",
    "same_payload",
]

EPOCH = datetime(1970, 1, 1)  # naive UTC, as the DATETIME columns hold it
CLAIM_TRIES = 3  # a lost claim whose row vanished (released meanwhile) is claimed again
PROCESSING = int(RecordStatus.PROCESSING)  # plain ints: drivers render an IntEnum differently
PROCESSED = int(RecordStatus.PROCESSED)


def constant(value: int) -> ColumnElement[int]:
    """``value`` written into the statement instead of bound: it never changes, and every bound
    value is one more parameter to convert and send with each execution."""
    return literal_column(str(value), Integer())


NULL_RESULT = literal_column("'null'", Text())  # encode_result(None), as a constant


def record_columns(table: Table) -> list[ColumnClause[Any]]:
    """The columns a :class:`~idemq.stores.base.Record` is read from (by name)."""
    c = table.c
    return [
        c.consumer,
        c.message_id,
        c.status,
        c.business_id,
        c.payload_hash,
        c.result,
        c.owner,
        c.lease_until_ms,
        c.attempts,
        c.created_time,
        c.processed_time,
    ]


def row_record(row: Row[Any]) -> Record:
    """A record from a row of :func:`record_columns`: SQLAlchemy's (times aware UTC) or a
    :class:`~idemq.drivers.sql.DriverStatement`'s (naive UTC datetimes, or SQLite's text)."""
    return Record(
        consumer=row.consumer,
        message_id=row.message_id,
        status=RecordStatus(row.status),
        business_id=row.business_id,
        payload_hash=row.payload_hash,
        result=row.result,
        owner=row.owner,
        lease_until_ms=row.lease_until_ms,
        attempts=row.attempts,
        created_time=as_utc(row.created_time),
        processed_time=None if row.processed_time is None else as_utc(row.processed_time),
    )


def record_json(table: Table, json_array: Any) -> Label[Any]:
    """The record, less its key, as ONE JSON array column, built by the dialect's ``json_array``
    function (``func.json_build_array`` on PostgreSQL, ``func.json_array`` on MySQL); read back
    by :func:`json_record`.

    A claim reads the record it lost to this way: drivers build an object per column of a
    result (psycopg's ``Column``, PyMySQL's parsed field descriptor) and SQLAlchemy a processor
    per column, so one column costs a duplicate far less than the record's eleven.
    """
    array: ColumnElement[Any] = json_array(*record_columns(table)[2:], type_=JSON)
    return array.label("record")


def json_record(key: Key, values: Sequence[Any] | str) -> Record:
    """A record from :func:`record_json`'s array: a list (psycopg decodes JSON itself) or the
    array's text (PyMySQL and sqlite3 return JSON as text)."""
    fields: Sequence[Any] = json.loads(values) if isinstance(values, str) else values
    status, business_id, payload_hash, result, owner, lease_until_ms, attempts, created, done = (
        fields
    )
    return Record(
        consumer=key.consumer,
        message_id=key.message_id,
        status=RecordStatus(status),
        business_id=business_id,
        payload_hash=payload_hash,
        result=result,
        owner=owner,
        lease_until_ms=lease_until_ms,
        attempts=attempts,
        created_time=as_utc(created),
        processed_time=None if done is None else as_utc(done),
    )


def same_payload(current: ColumnElement[Any], new: ColumnElement[Any]) -> ColumnElement[bool]:
    """An expired lease is taken over only by the same message: a different payload under the
    same id must stay a lost claim, so the guard sees the record and raises
    PayloadMismatchError."""
    return or_(current.is_(None), new.is_(None), current == new)


class StatementClock:
    """Where a statement's "now" comes from: the database server's clock (``server_ms`` and
    ``server_now``, SQL expressions evaluated by the server) or, when those are None, the
    guard's clock, bound as the parameters :meth:`SqlPlans.claim_params` fills in.

    On the server's clock a lease is set as ``server now + b_lease_ms`` and judged against the
    server's now, so workers whose clocks disagree still agree on whether a lease is live.
    """

    def __init__(
        self,
        server_ms: ColumnElement[int] | None = None,
        server_now: ColumnElement[datetime] | None = None,
    ) -> None:
        self.server_ms = server_ms
        self.server_now = server_now

    @property
    def on_server(self) -> bool:
        return self.server_ms is not None

    def now_ms(self, suffix: str = "") -> ColumnElement[int]:
        """Epoch milliseconds now."""
        if self.server_ms is None:
            return bindparam(f"b_now_ms{suffix}", type_=BigInteger())
        return self.server_ms

    def now(self, suffix: str = "") -> ColumnElement[Any]:
        """Now as a naive UTC datetime (``created_time``, ``processed_time``)."""
        if self.server_now is None:
            return bindparam(f"b_now{suffix}")
        return self.server_now

    def lease_until(self, suffix: str = "") -> ColumnElement[int]:
        """The end of a lease that starts now."""
        if self.server_ms is None:
            return bindparam(f"b_lease_until_ms{suffix}", type_=BigInteger())
        return self.server_ms + bindparam(f"b_lease_ms{suffix}", type_=BigInteger())


CLIENT_CLOCK = StatementClock()


def new_row(
    transactional: bool, suffix: str = "", clock: StatementClock = CLIENT_CLOCK
) -> dict[str, Any]:
    """The VALUES of a claim's new row, bound to :meth:`SqlPlans.claim_params` (``suffix``: the
    row's index in a multi-row insert; ``clock``: where its times come from).

    Inside the business transaction it is written PROCESSED with result ``'null'``
    (= ``encode_result(None)``: a handler returning None needs no second statement); in lease
    mode PROCESSING, with the owner's lease.
    """

    def bound(name: str) -> Any:
        return bindparam(f"b_{name}{suffix}")

    row = {
        "consumer": bound("consumer"),
        "message_id": bound("message_id"),
        "business_id": bound("business_id"),
        "payload_hash": bound("payload_hash"),
        "owner": bound("owner"),
        "attempts": constant(1),
        "created_time": clock.now(suffix),
    }
    if transactional:
        row |= {"status": constant(PROCESSED), "result": NULL_RESULT, "lease_until_ms": null()}
        row["processed_time"] = clock.now(suffix)
    else:
        row |= {"status": constant(PROCESSING), "result": null(), "processed_time": null()}
        row["lease_until_ms"] = clock.lease_until(suffix)
    return row


def key_params(key: Key) -> dict[str, Any]:
    """The parameters of :attr:`SqlPlans.key_is`."""
    return {"b_consumer": key.consumer, "b_message_id": key.message_id}


@dataclass(frozen=True)
class PlanOptions:
    """How a store's plans are built: ``store_clock``, leases set and judged on the database
    server's clock instead of the guard's; ``expires_after_ms``, completed records older than
    that count as absent (see :meth:`SqlPlans.claim_unexpired`)."""

    store_clock: bool = False
    expires_after_ms: int | None = None


class SqlPlans(ABC):
    """The plans of one store's table; a dialect subclass supplies the claim, its insert and the
    size lookup.

    Every statement is built here once: the hot ones compiled once (:meth:`driver`), the others
    found in SQLAlchemy's compiled cache after their first use.
    """

    def __init__(self, table: Table, dialect: Dialect, options: PlanOptions | None = None) -> None:
        options = options or PlanOptions()
        self.table = table
        self.dialect = dialect
        self.expires_after_ms = options.expires_after_ms
        self.clock = self.server_clock() if options.store_clock else CLIENT_CLOCK
        clock = self.clock
        self.columns = record_columns(table)
        c = table.c
        owner_is = c.owner == bindparam("b_owner")
        processing = c.status == constant(PROCESSING)
        self.key_is = and_(
            c.consumer == bindparam("b_consumer"), c.message_id == bindparam("b_message_id")
        )
        self.get_stmt = self.driver(select(*self.columns).where(self.key_is))
        # Every consumer's record of one id through the primary key, not a scan of the table:
        # a recursive CTE walks the distinct consumers (each step one index probe: the next
        # consumer after the last), then each (consumer, id) is one key lookup.
        consumers = select(func.min(c.consumer).label("consumer")).cte("consumers", recursive=True)
        following = (
            select(func.min(c.consumer)).where(c.consumer > consumers.c.consumer).scalar_subquery()
        )
        consumers = consumers.union_all(select(following).where(consumers.c.consumer.is_not(None)))
        self.find_stmt = (
            select(*self.columns)
            .join(consumers, c.consumer == consumers.c.consumer)
            .where(c.message_id == bindparam("b_message_id"))
            .order_by(c.consumer)
        )
        self.in_progress_stmt = (
            select(*self.columns)
            .where(processing)
            .order_by(c.created_time)
            .limit(bindparam("b_limit"))
        )
        self.batch_stmt = self.driver(self.batch_read())
        # The result written only to the row this transaction claimed: a twin's committed row
        # carries another owner, so finding it is never mistaken for holding ours.
        self.confirm_stmt = self.driver(
            update(table).where(self.key_is, owner_is).values(result=bindparam("b_result"))
        )
        # A batch's rows, proven in one statement: each owner token is random and drawn for one
        # message, so an (id, owner) pair across two messages can never match.
        self.confirm_many_stmt = self.driver(
            select(func.count()).where(
                c.consumer == bindparam("b_consumer"),
                c.message_id.in_(bindparam("b_message_ids", expanding=True)),
                c.owner.in_(bindparam("b_owners", expanding=True)),
            )
        )
        self.complete_stmt = self.driver(
            update(table)
            .where(self.key_is, processing, owner_is)
            .values(
                status=constant(PROCESSED),
                result=bindparam("b_result"),
                processed_time=clock.now(),
                lease_until_ms=null(),
            )
        )
        self.release_stmt = self.driver(delete(table).where(self.key_is, processing, owner_is))
        self.release_in_stmt = self.driver(delete(table).where(self.key_is, owner_is))
        self.force_release_stmt = delete(table).where(self.key_is, processing)
        # An expired record, deleted only while it still is one: a racing claim that already
        # replaced it with a fresh record (or a new claim) leaves nothing here to delete.
        self.expire_stmt = self.driver(
            delete(table).where(
                self.key_is,
                c.status == constant(PROCESSED),
                c.processed_time < bindparam("b_cutoff", type_=UtcDateTime()),
            )
        )
        self.renew_stmt = self.driver(
            update(table)
            .where(self.key_is, processing, owner_is)
            .values(lease_until_ms=clock.lease_until())
        )
        # A processed record or an expired claim; a live lease only by forget_any_stmt.
        self.forget_stmt = self.driver(
            delete(table).where(
                self.key_is,
                or_(c.status == constant(PROCESSED), c.lease_until_ms <= clock.now_ms()),
            )
        )
        self.forget_any_stmt = self.driver(delete(table).where(self.key_is))
        self.purge_stmt: Any = delete(table).where(
            tuple_(c.consumer, c.message_id).in_(
                select(c.consumer, c.message_id)
                .where(c.status == constant(PROCESSED), c.processed_time < bindparam("b_cutoff"))
                .order_by(c.processed_time)  # the index's order: a range scan, never a table scan
                .limit(bindparam("b_limit"))
            )
        )
        # One scan of the table answers every count; transactional-mode rows are always
        # PROCESSED with no lease, so only lease-mode claims can be stuck.
        stuck = and_(processing, c.lease_until_ms <= clock.now_ms())
        judged_at = [] if clock.server_ms is None else [clock.server_ms.label("now_ms")]
        self.stats_stmt = select(
            *judged_at,
            func.sum(case((processing, 1), else_=0)).label("processing"),
            func.sum(case((c.status == constant(PROCESSED), 1), else_=0)).label("processed"),
            func.sum(case((stuck, 1), else_=0)).label("stuck"),
            func.min(case((processing, c.created_time))).label("oldest_processing"),
            func.min(c.processed_time).label("oldest_processed"),
        )
        # Built on first use per batch size: one multi-row INSERT per size seen.
        self._insert_many: dict[tuple[bool, int], DriverStatement] = {}

    def driver(self, statement: Any) -> DriverStatement:
        """``statement``, run for every message, compiled once for this store's dialect."""
        return DriverStatement(statement, self.dialect)

    def batch_read(self) -> Select[Any]:
        """The rows ``claim_many`` inserted or lost to, read in one statement."""
        c = self.table.c
        return select(*self.columns).where(
            c.consumer == bindparam("b_consumer"),
            c.message_id.in_(bindparam("b_message_ids", expanding=True)),
        )

    # -- what a dialect supplies -------------------------------------------------------------

    def server_clock(self) -> StatementClock:
        """The database server's clock, as SQL (``lease_clock="store"``); a dialect without one
        (SQLite runs in-process: its clock is the guard's) refuses it."""
        raise ConfigurationError(
            f"lease_clock='store' needs a database server's clock; {self.dialect.name} runs in "
            "this process, so its leases use the guard's clock (lease_clock='client')"
        )

    @abstractmethod
    def insert_ignore(self, rows: list[dict[str, Any]]) -> Insert:
        """``INSERT`` of ``rows`` that skips a row whose key exists (in this dialect's words)."""

    @abstractmethod
    def claim(self, request: ClaimRequest, transactional: bool) -> Plan[Claim]:
        """Insert the record, take over an expired lease (lease mode), or hand back the record."""

    @abstractmethod
    def size(self) -> Plan[tuple[int | None, str]]:
        """``(bytes or None, how)``: the table's size as the database reports it."""

    # -- claims ------------------------------------------------------------------------------

    def claim_params(self, request: ClaimRequest, transactional: bool) -> dict[str, Any]:
        """The parameters of :func:`new_row` ``(transactional)`` (plus the takeover's clock)."""
        params: dict[str, Any] = {
            "b_consumer": request.key.consumer,
            "b_message_id": request.key.message_id,
            "b_business_id": request.business_id,
            "b_payload_hash": request.payload_hash,
            "b_owner": request.owner,
            "b_now": EPOCH + MILLISECOND * request.now_ms,
        }
        if not transactional:
            params["b_lease_until_ms"] = request.lease_until_ms
            params["b_lease_ms"] = request.lease_ms
            params["b_now_ms"] = request.now_ms
        return params

    def claim_unexpired(self, request: ClaimRequest, transactional: bool) -> Plan[Claim]:
        """:meth:`claim`, where a record completed more than ``expires_after_ms`` before the
        request counts as absent: it is deleted, in the claim's own transaction (so a handler
        that fails in transactional mode rolls the deletion back with its claim), and the claim
        made again. The window is judged on the request's clock against the stored processed
        time; the delete checks it again on the row, so of two duplicates that meet the same
        expired record one deletes it and claims, the other finds the fresh claim."""
        expires_after_ms = self.expires_after_ms
        for _ in range(CLAIM_TRIES):
            claim = yield from self.claim(request, transactional)
            if expires_after_ms is None or claim.record is None:
                return claim
            if not claim.record.expired(request.now_ms, expires_after_ms):
                return claim
            cutoff = EPOCH + MILLISECOND * (request.now_ms - expires_after_ms)
            yield Step(self.expire_stmt, {**key_params(request.key), "b_cutoff": cutoff})
        raise StoreConflictError("an expired record kept coming back while being claimed")

    def claim_many(
        self, requests: Sequence[ClaimRequest], transactional: bool
    ) -> Plan[list[Claim]]:
        """One multi-row insert-ignore and one read for the whole batch (rare cases: per row)."""
        if not requests:
            return []
        # Insert in key order so concurrent overlapping batches lock rows in the same order
        # instead of deadlocking.
        ordered = sorted(requests, key=lambda r: r.key.message_id)
        params: dict[str, Any] = {}
        for i, request in enumerate(ordered):
            row = self.claim_params(request, transactional)
            params.update({f"{name}{i}": value for name, value in row.items()})
        inserted = (yield Step(self._insert_rows(transactional, len(ordered)), params)).rowcount
        if inserted == len(requests) and transactional:
            return [Claim.won()] * len(requests)
        read = {
            "b_consumer": requests[0].key.consumer,
            "b_message_ids": [r.key.message_id for r in requests],
        }
        reply = yield Step(self.batch_stmt, read)
        found = {row.message_id: row_record(row) for row in reply.rows}
        claims = []
        for request in requests:
            record = found.get(request.key.message_id)
            if record is not None and record.owner == request.owner:
                claims.append(Claim.won())
            elif (
                record is None
                or (not transactional and self._maybe_expired(record, request))
                or record.expired(request.now_ms, self.expires_after_ms)
            ):
                claims.append((yield from self.claim_unexpired(request, transactional)))
            else:
                claims.append(Claim.lost_to(record))
        return claims

    def _maybe_expired(self, record: Record, request: ClaimRequest) -> bool:
        """Whether a lease read by ``claim_many`` is worth a takeover claim. On the server's
        clock only the claim statement can tell, so every other owner's PROCESSING record is
        tried (the claim judges it atomically)."""
        if record.status is not RecordStatus.PROCESSING:
            return False
        return self.clock.on_server or record.lease_expired(request.now_ms)

    def _insert_rows(self, transactional: bool, count: int) -> DriverStatement:
        statement = self._insert_many.get((transactional, count))
        if statement is None:
            rows = [new_row(transactional, str(i), self.clock) for i in range(count)]
            statement = self.driver(self.insert_ignore(rows))
            self._insert_many[transactional, count] = statement
        return statement

    # -- the other primitives ----------------------------------------------------------------

    def confirm(self, key: Key, owner: str, result: str) -> Plan[None]:
        """Store the handler's result on the record ``owner`` claimed in this transaction, and
        prove by it that the transaction still holds that record: :class:`TransactionLostError`
        when it touched no row.

        It must touch the row even for a ``null`` result, already stored by the claim: when the
        server rolled the transaction back (InnoDB on a deadlock) and the handler went on, its
        later statements ran in a new transaction without the row, and only a statement that
        looks for the row can tell. MySQL's dialects connect with ``CLIENT_FOUND_ROWS``, so the
        count is of rows matched, not of rows whose value changed.
        """
        params = {**key_params(key), "b_owner": owner, "b_result": result}
        if (yield Step(self.confirm_stmt, params)).rowcount != 1:
            raise TransactionLostError(
                f"the dedup row of {key.message_id!r} ({key.consumer}) is no longer in this "
                "transaction: the server rolled it back (a deadlock or lock timeout the handler "
                "caught) or the handler deleted it; nothing is committed, the message runs again"
            )

    def confirm_many(self, keys: Sequence[Key], owners: Sequence[str]) -> Plan[None]:
        """:meth:`confirm` for a batch's rows (one consumer) whose results are stored: one read
        that finds every ``(key, owner)``, or :class:`TransactionLostError`."""
        if not keys:
            return
        params = {
            "b_consumer": keys[0].consumer,
            "b_message_ids": [key.message_id for key in keys],
            "b_owners": list(owners),
        }
        found = (yield Step(self.confirm_many_stmt, params)).rows[0][0]
        if found != len(keys):
            raise TransactionLostError(
                f"{len(keys) - found} of the batch's {len(keys)} dedup rows are no longer in "
                "this transaction: the server rolled it back (a deadlock or lock timeout a "
                "handler caught); nothing is committed, the batch runs again"
            )

    def complete(self, key: Key, owner: str, result: str, now_ms: int) -> Plan[None]:
        """PROCESSING → PROCESSED; :class:`~idemq.LeaseLostError` unless ``owner`` holds it."""
        params = {
            **key_params(key),
            "b_owner": owner,
            "b_result": result,
            "b_now": EPOCH + MILLISECOND * now_ms,
        }
        if (yield Step(self.complete_stmt, params)).rowcount != 1:
            raise LeaseLostError(
                f"lease on {key.message_id!r} ({key.consumer}) was lost before complete"
            )

    def release(self, key: Key, owner: str) -> Plan[None]:
        """Delete the PROCESSING record if ``owner`` still holds it."""
        yield Step(self.release_stmt, {**key_params(key), "b_owner": owner})

    def release_in(self, key: Key, owner: str) -> Plan[None]:
        """Undo a batch claim (written as PROCESSED) inside its transaction."""
        yield Step(self.release_in_stmt, {**key_params(key), "b_owner": owner})

    def get(self, key: Key) -> Plan[Record | None]:
        """The record of ``key``, or None."""
        reply = yield Step(self.get_stmt, key_params(key))
        return row_record(reply.rows[0]) if reply.rows else None

    def find(self, message_id: str) -> Plan[list[Record]]:
        """Every consumer's record of ``message_id``."""
        reply = yield Step(self.find_stmt, {"b_message_id": message_id})
        return [row_record(row) for row in reply.rows]

    def in_progress(self, limit: int) -> Plan[list[Record]]:
        """PROCESSING records, oldest first."""
        reply = yield Step(self.in_progress_stmt, {"b_limit": limit})
        return [row_record(row) for row in reply.rows]

    def purge_batch(self, cutoff_ms: int, limit: int) -> Plan[int]:
        """Delete up to ``limit`` PROCESSED records older than ``cutoff_ms``; how many went."""
        params = {"b_cutoff": EPOCH + MILLISECOND * cutoff_ms, "b_limit": limit}
        return (yield Step(self.purge_stmt, params)).rowcount

    def renew(self, key: Key, owner: str, lease_until_ms: int, now_ms: int) -> Plan[bool]:
        """Extend ``owner``'s live claim (to ``lease_until_ms``, or on the server's clock by as
        long from the server's now); False when ``owner`` no longer holds it."""
        params = {
            **key_params(key),
            "b_owner": owner,
            "b_lease_until_ms": lease_until_ms,
            "b_lease_ms": lease_until_ms - now_ms,
        }
        return (yield Step(self.renew_stmt, params)).rowcount == 1

    def forget(self, key: Key, *, force: bool, now_ms: int) -> Plan[ForgetResult]:
        """Delete ``key``'s record unless it is a live lease (or ``force``); the read after a
        refused delete is in the same transaction, so it sees what the delete saw."""
        if force:
            deleted = (yield Step(self.forget_any_stmt, key_params(key))).rowcount
        else:
            params = {**key_params(key), "b_now_ms": now_ms}
            deleted = (yield Step(self.forget_stmt, params)).rowcount
        if deleted:
            return ForgetResult.FORGOTTEN
        if force or not (yield Step(self.get_stmt, key_params(key))).rows:
            return ForgetResult.NOT_FOUND
        return ForgetResult.LIVE_LEASE

    def force_release(self, key: Key) -> Plan[bool]:
        """Delete the PROCESSING record whoever owns it (never a PROCESSED one)."""
        return (yield Step(self.force_release_stmt, key_params(key))).rowcount == 1

    def stats(self, now_ms: int) -> Plan[StoreStats]:
        """Counts by status, oldest records and stuck leases at ``now_ms``, and the size."""
        counts = (yield Step(self.stats_stmt, {"b_now_ms": now_ms})).rows[0]
        if self.clock.on_server:
            now_ms = int(counts.now_ms)
        size_bytes, size_method = yield from self.size()
        return StoreStats(
            processing=int(counts.processing or 0),
            processed=int(counts.processed or 0),
            stuck=int(counts.stuck or 0),
            oldest_processing=counts.oldest_processing,
            oldest_processed=counts.oldest_processed,
            size_bytes=size_bytes,
            size_method=size_method,
            now_ms=now_ms,
        )
