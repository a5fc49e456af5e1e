"""What ``idemq stats``, ``idemq inspect`` and ``idemq release`` do, as library functions.

The CLI only parses arguments, calls these and prints what they return; everything here works
on any store (sync) and returns plain, JSON-ready data. Nothing here prints a URL: stores are
named by :func:`idemq.stores.store_label` and their masked ``where``/``repr``.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from idemq._clock import system_clock_ms
from idemq.drivers.sql import parse_url
from idemq.errors import ConfigurationError
from idemq.stores import is_redis_url, open_store, store_label
from idemq.stores.base import DEFAULT_CONSUMER, Record, RecordStatus, StoreStats

__all__ = [
    "ReleasePlan",
    "ReleaseVerdict",
    "find_records",
    "open_store_for",
    "plan_release",
    "record_dict",
    "release",
    "stats_report",
]

STUCK_SHOWN = 10  # stuck records listed by `idemq stats` (the count covers all of them)


def open_store_for(
    url: str,
    *,
    table: str | None = None,
    prefix: str | None = None,
    must_exist: bool = False,
    **options: Any,
) -> Any:
    """The store at ``url``, on a non-default SQL ``table`` or Redis key ``prefix`` if given;
    ``options`` go to the store's constructor as they are.

    ``must_exist``: a SQLite URL naming a file that does not exist is a
    :class:`~idemq.ConfigurationError` (SQLite would create an empty database there: a mistyped
    path would answer "nothing found" instead of saying so).
    """
    if must_exist:
        _check_sqlite_file_exists(url)
    if is_redis_url(url):
        if table is not None:
            raise ConfigurationError("--table is for SQL stores; a Redis store takes --prefix")
        return (
            open_store(url, **options)
            if prefix is None
            else open_store(url, prefix=prefix, **options)
        )
    if prefix is not None:
        raise ConfigurationError("--prefix is for Redis stores; an SQL store takes --table")
    return open_store(url, **options) if table is None else open_store(url, table=table, **options)


def _check_sqlite_file_exists(url: str) -> None:
    if is_redis_url(url):
        return
    parsed = parse_url(url)
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or database in (None, "", ":memory:"):
        return
    if database.startswith("file:"):  # a URI filename: SQLite's own options decide
        return
    if not Path(database).is_file():
        raise ConfigurationError(
            f"no SQLite database at {database!r} (check the path; it is not created here)"
        )


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def record_dict(record: Record, *, now_ms: int | None = None) -> dict[str, Any]:
    """A store record as JSON-ready data (result decoded; the payload itself is never stored,
    only its SHA-256). With ``now_ms``, adds ``lease_expired`` for PROCESSING records."""
    data: dict[str, Any] = {
        "consumer": record.consumer,
        "message_id": record.message_id,
        "status": record.status.name.lower(),
        "business_id": record.business_id,
        "payload_hash": record.payload_hash,
        "result": None if record.result is None else json.loads(record.result),
        "owner": record.owner,
        "lease_until_ms": record.lease_until_ms,
        "attempts": record.attempts,
        "created_time": _iso(record.created_time),
        "processed_time": _iso(record.processed_time),
    }
    if now_ms is not None and record.status is RecordStatus.PROCESSING:
        data["lease_expired"] = record.lease_expired(now_ms)
    return data


def _age_s(stats: StoreStats, then: datetime | None) -> float | None:
    return None if then is None else round(stats.now_ms / 1000 - then.timestamp(), 3)


def stats_report(store: Any, *, now_ms: int | None = None) -> dict[str, Any]:
    """``store.stats()`` plus the oldest stuck records, as one JSON-ready dict."""
    stats: StoreStats = store.stats(now_ms=system_clock_ms() if now_ms is None else now_ms)
    now = stats.now_ms  # the store's own clock when its leases run on it
    stuck: list[Record] = []
    if stats.stuck:
        # in_progress is oldest first, so the stuck ones we show are the oldest stuck ones.
        stuck = [r for r in store.in_progress(limit=100) if r.lease_expired(now)][:STUCK_SHOWN]
    return {
        "store": store_label(store),
        "records": {"processing": stats.processing, "processed": stats.processed},
        "total": stats.total,
        "stuck_leases": stats.stuck,
        "oldest_processing": _iso(stats.oldest_processing),
        "oldest_processing_age_s": _age_s(stats, stats.oldest_processing),
        "oldest_processed": _iso(stats.oldest_processed),
        "size_bytes": stats.size_bytes,
        "size_method": stats.size_method,
        "now": _iso(datetime.fromtimestamp(now / 1000, UTC)),
        "stuck_records": [record_dict(r, now_ms=now) for r in stuck],
    }


def find_records(
    store: Any, message_id: str, consumer: str | None = None, *, now_ms: int | None = None
) -> list[dict[str, Any]]:
    """Every consumer's record of ``message_id`` (or only ``consumer``'s), JSON-ready."""
    now = system_clock_ms() if now_ms is None else now_ms
    records = store.find(message_id)
    if consumer is not None:
        records = [r for r in records if r.consumer == consumer]
    return [record_dict(r, now_ms=now) for r in records]


class ReleaseVerdict(enum.Enum):
    """Whether ``idemq release`` may go ahead."""

    RELEASABLE = "releasable"  # one PROCESSING record: ask the operator, then force_release
    NOT_FOUND = "not_found"
    PROCESSED = "processed"  # refused: deleting it would let the message run twice
    AMBIGUOUS = "ambiguous"  # several consumers hold it PROCESSING: name one with --consumer


@dataclass(frozen=True, slots=True)
class ReleasePlan:
    """What ``release`` would do: the verdict, the record(s) concerned, a warning if any."""

    verdict: ReleaseVerdict
    records: list[Record] = field(default_factory=list)
    lease_live: bool = False  # the lease has not expired: its worker may still be running

    @property
    def record(self) -> Record:
        """The one record to release (only for RELEASABLE / PROCESSED)."""
        return self.records[0]


def plan_release(
    store: Any, message_id: str, consumer: str | None = None, *, now_ms: int | None = None
) -> ReleasePlan:
    """Look before releasing; without ``consumer`` the one PROCESSING record of the id is meant."""
    now = system_clock_ms() if now_ms is None else now_ms
    if consumer is not None:
        one = store.get(message_id, consumer)
        records = [] if one is None else [one]
    else:
        records = store.find(message_id)
    if not records:
        return ReleasePlan(ReleaseVerdict.NOT_FOUND)
    processing = [r for r in records if r.status is RecordStatus.PROCESSING]
    if not processing:
        return ReleasePlan(ReleaseVerdict.PROCESSED, records)
    if len(processing) > 1:
        return ReleasePlan(ReleaseVerdict.AMBIGUOUS, processing)
    record = processing[0]
    return ReleasePlan(ReleaseVerdict.RELEASABLE, [record], not record.lease_expired(now))


def release(store: Any, record: Record) -> bool:
    """Force-release ``record`` (PROCESSING, whoever owns it); False if it completed meanwhile
    or is gone — the store re-checks the status atomically."""
    consumer = record.consumer or DEFAULT_CONSUMER
    released: bool = store.force_release(record.message_id, consumer)
    return released
