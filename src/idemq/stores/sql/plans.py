"""The SQL of every store primitive, written once as I/O-free *plans* (portable SQL here).

A plan is a generator that yields ``(sql, params, returns_rows)`` steps and receives each
step's :class:`Reply`; its return value is the primitive's answer.
:class:`~idemq.stores.sql.SqlStore` runs plans on a sync connection (straight on the DBAPI
cursor: SQLAlchemy's compiler and result machinery stay out of the per-message path, see
``bench/sql_guard.py``) and :class:`~idemq.stores.sql.AsyncSqlStore` on an async one, so the two
cannot drift apart.

What differs per dialect (the claim, above all) is in :mod:`idemq.stores.sql.dialects`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any, ClassVar

from idemq.drivers.sql import Plan
from idemq.errors import StoreConflictError
from idemq.stores.base import (
    MILLISECOND,
    Claim,
    ClaimRequest,
    Key,
    Record,
    RecordStatus,
    StoreStats,
)
from idemq.stores.sql.schema import as_utc

__all__ = [
    "CLAIM_TRIES",
    "COLS",
    "INSERT_COLS",
    "KEY_WHERE",
    "SAME_PAYLOAD",
    "Ops",
    "Plan",
    "json_record",
    "key_params",
    "row_record",
]

COLS = (
    "consumer, message_id, status, business_id, payload_hash, result, owner, "
    "lease_until_ms, attempts, created_time, processed_time"
)
INSERT_COLS = (
    "consumer, message_id, business_id, status, payload_hash, result, owner, "
    "lease_until_ms, attempts, processed_time, created_time"
)
KEY_WHERE = "consumer = :consumer AND message_id = :message_id"
EPOCH = datetime(1970, 1, 1)  # naive UTC, as the DATETIME columns hold it
CLAIM_TRIES = 3  # a lost claim whose row vanished (released meanwhile) is claimed again


_STATUSES = {int(status): status for status in RecordStatus}


def row_record(row: Sequence[Any]) -> Record:
    """A record from a row of :data:`COLS` (positional: a duplicate builds one per message)."""
    return Record(
        row[0],
        row[1],
        _STATUSES[int(row[2])],
        row[3],
        row[4],
        row[5],
        row[6],
        None if row[7] is None else int(row[7]),
        int(row[8]),
        None if row[9] is None else as_utc(row[9]),
        None if row[10] is None else as_utc(row[10]),
    )


# An expired lease is taken over only by the same message: a different payload under the same id
# must stay a lost claim, so the guard sees the record and raises PayloadMismatchError.
SAME_PAYLOAD = (
    "AND ({cur}.payload_hash IS NULL OR {new}.payload_hash IS NULL "
    "OR {cur}.payload_hash = {new}.payload_hash)"
)

# The claim path reads a record as ONE JSON text column: drivers pay per column (PyMySQL parses
# every column descriptor in Python — measured at ~100 µs for the full row), one column is cheap.
JSON_COLS = (
    "status, business_id, payload_hash, result, owner, lease_until_ms, attempts, "
    "created_time, processed_time"
)


def json_record(key: Key, text: str | bytes) -> Record:
    """A record read by the claim path (``record_json`` of :class:`Ops`): :data:`JSON_COLS` are
    :data:`COLS` without the key, in the same order."""
    return row_record((key.consumer, key.message_id, *json.loads(text)))


def key_params(key: Key) -> dict[str, Any]:
    return {"consumer": key.consumer, "message_id": key.message_id}


class Ops:
    """Portable SQL; dialects override the claim. ``table`` is the already-quoted table name."""

    insert_ignore = (
        "INSERT INTO {t} ({cols}) VALUES {values} ON CONFLICT (consumer, message_id) DO NOTHING"
    )
    lock_suffix = ""  # MySQL reads the latest committed row with a locking read
    record_json = f"json_array({JSON_COLS})"  # SQLite >= 3.38, MySQL, MariaDB

    def __init__(
        self, table: str, *, pyformat: bool, name: str | None = None, schema: str | None = None
    ) -> None:
        self.table = table
        self._pyformat = pyformat
        self.name = name or table  # unquoted, for catalog lookups (size)
        self.schema = schema
        t = table
        self.sql_get = self.sql(f"SELECT {COLS} FROM {t} WHERE {KEY_WHERE}")
        self.sql_claim_read = self.sql(
            f"SELECT {self.record_json} FROM {t} WHERE {KEY_WHERE}{self.lock_suffix}"
        )
        self.sql_find = self.sql(
            f"SELECT {COLS} FROM {t} WHERE message_id = :message_id ORDER BY consumer"
        )
        self.sql_in_progress = self.sql(
            f"SELECT {COLS} FROM {t} WHERE status = 0 ORDER BY created_time LIMIT :limit"
        )
        self.sql_save_result = self.sql(f"UPDATE {t} SET result = :result WHERE {KEY_WHERE}")
        self.sql_complete = self.sql(
            f"UPDATE {t} SET status = 1, result = :result, processed_time = :now, "
            f"lease_until_ms = NULL WHERE {KEY_WHERE} AND status = 0 AND owner = :owner"
        )
        self.sql_release = self.sql(
            f"DELETE FROM {t} WHERE {KEY_WHERE} AND status = 0 AND owner = :owner"
        )
        self.sql_release_in = self.sql(f"DELETE FROM {t} WHERE {KEY_WHERE} AND owner = :owner")
        self.sql_takeover = self.sql(
            f"UPDATE {t} SET owner = :owner, lease_until_ms = :lease_until_ms, "
            f"attempts = attempts + 1 WHERE {KEY_WHERE} AND status = 0 "
            "AND lease_until_ms <= :now_ms AND (payload_hash IS NULL OR :payload_hash IS NULL "
            "OR payload_hash = :payload_hash)"
        )
        self.sql_purge = self.sql(self.purge_template.format(t=t))
        self.sql_force_release = self.sql(f"DELETE FROM {t} WHERE {KEY_WHERE} AND status = 0")
        # One scan of the table answers every count; transactional-mode rows are always
        # status 1 with no lease, so only lease-mode claims can be stuck.
        self.sql_stats = self.sql(
            "SELECT SUM(CASE WHEN status = 0 THEN 1 ELSE 0 END), "
            "SUM(CASE WHEN status = 1 THEN 1 ELSE 0 END), "
            "SUM(CASE WHEN status = 0 AND lease_until_ms <= :now_ms THEN 1 ELSE 0 END), "
            f"MIN(CASE WHEN status = 0 THEN created_time END), MIN(processed_time) FROM {t}"
        )

    purge_template = (
        "DELETE FROM {t} WHERE (consumer, message_id) IN (SELECT consumer, message_id FROM {t} "
        "WHERE status = 1 AND processed_time < :cutoff LIMIT :limit)"
    )

    # -- rendering ---------------------------------------------------------------------------

    def sql(self, text: str) -> str:
        """``:name`` placeholders → the driver's style (``%(name)s`` for psycopg/PyMySQL)."""
        if not self._pyformat:
            return text
        return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", text)

    def timestamp(self, now_ms: int) -> Any:
        """A naive-UTC DATETIME parameter (SQLite overrides: it stores text)."""
        return EPOCH + MILLISECOND * now_ms

    def claim_params(self, request: ClaimRequest, transactional: bool) -> dict[str, Any]:
        """Parameters of :data:`VALUES` ``[transactional]`` (only those: drivers escape each)."""
        params = {
            "consumer": request.key.consumer,
            "message_id": request.key.message_id,
            "business_id": request.business_id,
            "payload_hash": request.payload_hash,
            "owner": request.owner,
            "now": self.timestamp(request.now_ms),
        }
        if not transactional:
            params["lease_until_ms"] = request.lease_until_ms
            params["now_ms"] = request.now_ms
        return params

    # The new row. Inside the business transaction it is written PROCESSED, with result 'null'
    # (= encode_result(None): a handler returning None needs no second statement); in lease mode
    # PROCESSING, with the owner's lease.
    VALUES: ClassVar[dict[bool, str]] = {
        True: "(:consumer, :message_id, :business_id, 1, :payload_hash, 'null', :owner, "
        "NULL, 1, :now, :now)",
        False: "(:consumer, :message_id, :business_id, 0, :payload_hash, NULL, :owner, "
        ":lease_until_ms, 1, NULL, :now)",
    }

    # -- claims ------------------------------------------------------------------------------

    def claim(self, request: ClaimRequest, transactional: bool) -> Plan:
        """Generic claim (MySQL): insert-ignore, conditional takeover, then read the winner."""
        params = self.claim_params(request, transactional)
        insert = self.sql(
            self.insert_ignore.format(
                t=self.table, cols=INSERT_COLS, values=self.VALUES[transactional]
            )
        )
        for _ in range(CLAIM_TRIES):
            if (yield insert, params, False).rowcount == 1:
                return Claim.won()
            if not transactional and (yield self.sql_takeover, params, False).rowcount == 1:
                return Claim.won()
            reply = yield self.sql_claim_read, key_params(request.key), True
            if reply.rows:
                return Claim.lost_to(json_record(request.key, reply.rows[0][0]))
        raise StoreConflictError("the record kept vanishing while being claimed")

    def claim_many(self, requests: Sequence[ClaimRequest], transactional: bool) -> Plan:
        """One multi-row insert-ignore and one read for the whole batch (rare cases: per row)."""
        if not requests:
            return []
        # Insert in key order so concurrent overlapping batches lock rows in the same order
        # instead of deadlocking.
        ordered = sorted(requests, key=lambda r: r.key.message_id)
        params: dict[str, Any] = {}
        values = []
        for i, request in enumerate(ordered):
            values.append(re.sub(r":(\w+)", rf":\g<1>{i}", self.VALUES[transactional]))
            row = self.claim_params(request, transactional)
            params.update({f"{name}{i}": value for name, value in row.items()})
        insert = self.insert_ignore.format(t=self.table, cols=INSERT_COLS, values=", ".join(values))
        inserted = (yield self.sql(insert), params, False).rowcount
        if inserted == len(requests) and transactional:
            return [Claim.won()] * len(requests)
        ids = {f"m{i}": r.key.message_id for i, r in enumerate(requests)}
        select = (
            f"SELECT {COLS} FROM {self.table} WHERE consumer = :consumer AND message_id IN "
            f"({', '.join(':' + name for name in ids)}){self.lock_suffix}"
        )
        reply = yield self.sql(select), {"consumer": requests[0].key.consumer, **ids}, True
        found = {row[1]: row_record(row) for row in reply.rows}
        claims = []
        for request in requests:
            record = found.get(request.key.message_id)
            if record is not None and record.owner == request.owner:
                claims.append(Claim.won())
            elif record is None or (not transactional and record.lease_expired(request.now_ms)):
                claims.append((yield from self.claim(request, transactional)))
            else:
                claims.append(Claim.lost_to(record))
        return claims

    # -- the other primitives ----------------------------------------------------------------

    def save_result(self, key: Key, result: str) -> Plan:
        yield self.sql_save_result, {**key_params(key), "result": result}, False

    def complete(self, key: Key, owner: str, result: str, now_ms: int) -> Plan:
        params = {
            **key_params(key),
            "owner": owner,
            "result": result,
            "now": self.timestamp(now_ms),
        }
        return (yield self.sql_complete, params, False).rowcount == 1

    def release(self, key: Key, owner: str) -> Plan:
        yield self.sql_release, {**key_params(key), "owner": owner}, False

    def release_in(self, key: Key, owner: str) -> Plan:
        """Undo a batch claim (written as PROCESSED) inside its transaction."""
        yield self.sql_release_in, {**key_params(key), "owner": owner}, False

    def get(self, key: Key) -> Plan:
        reply = yield self.sql_get, key_params(key), True
        return row_record(reply.rows[0]) if reply.rows else None

    def find(self, message_id: str) -> Plan:
        reply = yield self.sql_find, {"message_id": message_id}, True
        return [row_record(row) for row in reply.rows]

    def in_progress(self, limit: int) -> Plan:
        reply = yield self.sql_in_progress, {"limit": limit}, True
        return [row_record(row) for row in reply.rows]

    def purge_batch(self, cutoff_ms: int, limit: int) -> Plan:
        reply = yield self.sql_purge, {"cutoff": self.timestamp(cutoff_ms), "limit": limit}, False
        return reply.rowcount

    def force_release(self, key: Key) -> Plan:
        """Delete the PROCESSING record whoever owns it (never a PROCESSED one)."""
        return (yield self.sql_force_release, key_params(key), False).rowcount == 1

    def stats(self, now_ms: int) -> Plan:
        reply = yield self.sql_stats, {"now_ms": now_ms}, True
        processing, processed, stuck, oldest_processing, oldest_processed = reply.rows[0]
        size_bytes, size_method = yield from self.size()
        return StoreStats(
            processing=int(processing or 0),
            processed=int(processed or 0),
            stuck=int(stuck or 0),
            oldest_processing=None if oldest_processing is None else as_utc(oldest_processing),
            oldest_processed=None if oldest_processed is None else as_utc(oldest_processed),
            size_bytes=size_bytes,
            size_method=size_method,
            now_ms=now_ms,
        )

    def size(self) -> Plan:
        """``(bytes or None, how)``: the table's size as the database reports it."""
        yield from ()  # a plan with no statement: the generic dialect has no size function
        return None, "unknown on this database"
