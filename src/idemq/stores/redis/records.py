"""The stored record format, read in one place (written by the scripts in :mod:`.scripts`)."""

from __future__ import annotations

from datetime import UTC, datetime

from idemq.drivers.redis import text
from idemq.errors import StoreError
from idemq.stores.base import MILLISECOND, Key, Record, RecordStatus
from idemq.stores.redis.scripts import FIELDS

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


_STATUSES = {str(int(status)): status for status in RecordStatus}


def _datetime(ms: str | None) -> datetime | None:
    return _EPOCH + MILLISECOND * int(ms) if ms else None


def parse_record(key: Key, stored: bytes | str | None) -> Record | None:
    """A :class:`Record` from a stored record (a GET, or a claim's conflict reply, which is the
    record as stored: the :data:`FIELDS` joined by NUL); ``None`` when it is absent."""
    if stored is None:
        return None
    values = text(stored).split("\0", len(FIELDS) - 1)  # the result, last, may hold anything
    if len(values) != len(FIELDS):
        raise StoreError(f"malformed idemq record for {key!r}: {len(values)} fields")
    s, owner, lease, attempts, created, processed, business_id, payload_hash, result = values
    status = _STATUSES.get(s)
    try:
        if status is None:  # someone else's value under our prefix, or a corrupted record
            raise ValueError(f"unknown status {s!r}")  # noqa: TRY301 - one message for both
        done = status is RecordStatus.PROCESSED
        # Positional (the fields' order), as a duplicate parses one per message: keywords cost
        # as much as building the record itself.
        return Record(
            key.consumer,
            key.message_id,
            status,
            business_id or None,
            payload_hash or None,
            # A result is only ever written together with status 1, but keep the invariant local.
            result if done else None,
            owner or None,
            int(lease) if lease and not done else None,
            int(attempts or 1),
            _datetime(created),
            _datetime(processed),
        )
    except ValueError as exc:
        raise StoreError(f"malformed idemq record for {key!r}: {values[:6]!r}") from exc
