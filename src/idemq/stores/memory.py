"""An in-process lease store: for tests, examples and single-process tools.

It has the exact semantics of the SQL and Redis lease stores (the contract suite runs against it),
but it forgets everything when the process exits: never use it to guard real effects.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from copy import copy
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from idemq._clock import process_fence_us, system_clock_ms
from idemq.errors import LeaseLostError
from idemq.stores.base import (
    DEFAULT_CONSUMER,
    Claim,
    ClaimRequest,
    ForgetResult,
    Key,
    Record,
    RecordStatus,
    StoreStats,
    expiry_ms,
)

__all__ = ["MemoryStore"]


def _utc(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


class MemoryStore:
    """A dict behind a lock; every primitive is atomic because it holds the lock throughout.

    Records are replaced, never changed in place, and handed out as copies: what a caller does
    with a record it was given never reaches the store (as with the SQL and Redis stores).

    ``expires_after_s``: as :class:`~idemq.SqlStore`'s — a record completed longer ago than
    that counts as absent, and its message runs again.
    """

    def __init__(self, *, expires_after_s: float | None = None) -> None:
        self._records: dict[Key, Record] = {}
        self._lock = threading.Lock()
        self.expires_after_ms = expiry_ms(expires_after_s)

    def claim(self, request: ClaimRequest) -> Claim:
        with self._lock:
            return self._claim(request)

    def _claim(self, request: ClaimRequest) -> Claim:
        current = self._records.get(request.key)
        if current is None or current.expired(request.now_ms, self.expires_after_ms):
            self._records[request.key] = Record(
                consumer=request.key.consumer,
                message_id=request.key.message_id,
                status=RecordStatus.PROCESSING,
                business_id=request.business_id,
                payload_hash=request.payload_hash,
                owner=request.owner,
                lease_until_ms=request.lease_until_ms,
                created_time=_utc(request.now_ms),
            )
            return Claim.won(process_fence_us())
        same_message = (
            current.payload_hash is None
            or request.payload_hash is None
            or current.payload_hash == request.payload_hash
        )
        if (
            current.status is RecordStatus.PROCESSING
            and current.lease_expired(request.now_ms)
            and same_message  # another payload must see the record (PayloadMismatchError)
        ):
            self._records[request.key] = replace(
                current,
                owner=request.owner,
                lease_until_ms=request.lease_until_ms,
                attempts=current.attempts + 1,
            )
            return Claim.won(process_fence_us())
        return Claim.lost_to(copy(current))

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        with self._lock:
            return [self._claim(request) for request in requests]

    def complete(self, key: Key, owner: str, result: str, now_ms: int) -> None:
        with self._lock:
            current = self._records.get(key)
            if (
                current is None
                or current.status is not RecordStatus.PROCESSING
                or current.owner != owner
            ):
                raise LeaseLostError(f"lease on {key.message_id!r} was lost before complete")
            self._records[key] = replace(
                current,
                status=RecordStatus.PROCESSED,
                result=result,
                lease_until_ms=None,
                processed_time=_utc(now_ms),
            )

    def release(self, key: Key, owner: str) -> None:
        with self._lock:
            current = self._records.get(key)
            if (
                current is not None
                and current.status is RecordStatus.PROCESSING
                and current.owner == owner
            ):
                del self._records[key]

    def get(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> Record | None:
        with self._lock:
            record = self._records.get(Key(consumer, message_id))
        return None if record is None else copy(record)

    def find(self, message_id: str) -> list[Record]:
        with self._lock:
            found = [copy(r) for k, r in self._records.items() if k.message_id == message_id]
        return sorted(found, key=lambda r: r.consumer)

    def in_progress(self, *, limit: int = 100) -> list[Record]:
        with self._lock:
            found = [copy(r) for r in self._records.values() if r.status is RecordStatus.PROCESSING]
        return sorted(found, key=lambda r: r.created_time or _utc(0))[:limit]

    def purge(
        self, older_than: timedelta, *, batch_size: int = 1000, now_ms: int | None = None
    ) -> int:
        cutoff = _utc(now_ms if now_ms is not None else system_clock_ms()) - older_than
        with self._lock:
            doomed = [
                k
                for k, r in self._records.items()
                if r.status is RecordStatus.PROCESSED
                and r.processed_time is not None
                and r.processed_time < cutoff
            ]
            for k in doomed:
                del self._records[k]
        return len(doomed)

    def stats(self, *, now_ms: int | None = None) -> StoreStats:
        """Counts, oldest records and stuck leases; no size (it lives in this process)."""
        now = now_ms if now_ms is not None else system_clock_ms()
        with self._lock:
            records = list(self._records.values())
        processing = [r for r in records if r.status is RecordStatus.PROCESSING]
        processed = [r.processed_time for r in records if r.processed_time is not None]
        return StoreStats(
            processing=len(processing),
            processed=len(records) - len(processing),
            stuck=sum(1 for r in processing if r.lease_expired(now)),
            oldest_processing=min(
                (r.created_time for r in processing if r.created_time), default=None
            ),
            oldest_processed=min(processed, default=None),
            size_bytes=None,
            size_method="unknown (in-process memory)",
            now_ms=now,
        )

    def force_release(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> bool:
        """Delete the PROCESSING record whoever owns it; a PROCESSED one is left alone."""
        key = Key(consumer, message_id)
        with self._lock:
            current = self._records.get(key)
            if current is None or current.status is not RecordStatus.PROCESSING:
                return False
            del self._records[key]
            return True

    def renew(self, key: Key, owner: str, lease_until_ms: int, now_ms: int) -> bool:
        """See :meth:`idemq.stores.base.GuardStore.renew`."""
        with self._lock:
            current = self._records.get(key)
            if current is None or current.status is not RecordStatus.PROCESSING:
                return False
            if current.owner != owner:
                return False
            self._records[key] = replace(current, lease_until_ms=lease_until_ms)
            return True

    def forget(
        self,
        message_id: str,
        consumer: str = DEFAULT_CONSUMER,
        *,
        force: bool = False,
        now_ms: int | None = None,
    ) -> ForgetResult:
        """See :meth:`idemq.stores.base.GuardStore.forget`."""
        now = system_clock_ms() if now_ms is None else now_ms
        key = Key(consumer, message_id)
        with self._lock:
            current = self._records.get(key)
            if current is None:
                return ForgetResult.NOT_FOUND
            live = current.status is RecordStatus.PROCESSING and not current.lease_expired(now)
            if live and not force:
                return ForgetResult.LIVE_LEASE
            del self._records[key]
            return ForgetResult.FORGOTTEN

    def close(self) -> None:
        """Nothing to close."""
