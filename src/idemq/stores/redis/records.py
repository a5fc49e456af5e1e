"""The stored record format, written and read in one place (the Lua scripts follow it too).

A record is one Redis string (one key, so one Cluster slot): the values of
:data:`RECORD_FIELDS` joined by NUL, in that order::

    status          "0" PROCESSING, "1" PROCESSED
    owner           owner token of the claim
    lease_until_ms  end of the lease (PROCESSING only)
    attempts        1 + takeovers
    created_ms      when the message was first claimed
    processed_ms    when it was completed (PROCESSED only)
    business_id     "" = none
    payload_hash    sha256 hex of the payload, "" = none
    result          the handler's result as JSON text (PROCESSED only)

Why one string and not a hash: the stored value *is* the reply a duplicate needs, so a
duplicate is answered by the claim's own ``SET … NX GET``, handed back as it is. NUL separates
because no value but the result can hold one (the store refuses an owner, business id or hash
with a NUL; the rest are digits), and the result is last: a reader splits at most eight times
and keeps the result whole.

Times are epoch milliseconds from the guard's clock. Existing records must keep parsing: the
field order and the separator never change without a new prefix.
"""

from __future__ import annotations

from datetime import UTC, datetime

from idemq.drivers.redis import text
from idemq.errors import StoreError
from idemq.stores.base import MILLISECOND, Key, Record, RecordStatus

__all__ = ["EPOCH", "RECORD_FIELDS", "SEPARATOR", "format_record", "parse_record"]

RECORD_FIELDS = (
    "status",
    "owner",
    "lease_until_ms",
    "attempts",
    "created_ms",
    "processed_ms",
    "business_id",
    "payload_hash",
    "result",
)
"""The values of a record, in their stored order."""

SEPARATOR = "\0"
"""Joins the values of a record (no value but the result can hold it)."""

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
"""Stored times are epoch milliseconds; records read them back as aware UTC datetimes."""

_STATUSES = {str(int(status)): status for status in RecordStatus}


def format_record(
    *,
    status: RecordStatus,
    owner: str,
    lease_until_ms: int | None,
    attempts: int,
    created_ms: int,
    processed_ms: int | None,
    business_id: str | None,
    payload_hash: str | None,
    result: str | None,
) -> str:
    """A record as stored (``None`` is written as an empty value).

    The caller keeps NUL out of every value but ``result``, which is last.
    """
    return SEPARATOR.join(
        (
            str(int(status)),
            owner,
            _ms(lease_until_ms),
            str(attempts),
            str(created_ms),
            _ms(processed_ms),
            business_id or "",
            payload_hash or "",
            result or "",
        )
    )


def _ms(value: int | None) -> str:
    return "" if value is None else str(value)


def _datetime(ms: str) -> datetime | None:
    return EPOCH + MILLISECOND * int(ms) if ms else None


def parse_record(key: Key, stored: bytes | str | None) -> Record | None:
    """A :class:`Record` from a stored record (a GET, or a claim's conflict reply, which is the
    record as stored); ``None`` when it is absent. Anything else raises :class:`StoreError`."""
    if stored is None:
        return None
    values = text(stored).split(SEPARATOR, len(RECORD_FIELDS) - 1)  # the result may hold NUL
    if len(values) != len(RECORD_FIELDS):
        raise StoreError(f"malformed idemq record for {key!r}: {len(values)} fields")
    (
        stored_status,
        owner,
        lease_until_ms,
        attempts,
        created_ms,
        processed_ms,
        business_id,
        payload_hash,
        result,
    ) = values  # RECORD_FIELDS, in order
    status = _STATUSES.get(stored_status)
    try:
        if status is None:  # someone else's value under our prefix, or a corrupted record
            raise ValueError(f"unknown status {stored_status!r}")  # noqa: TRY301 - one message
        done = status is RecordStatus.PROCESSED
        return Record(
            consumer=key.consumer,
            message_id=key.message_id,
            status=status,
            business_id=business_id or None,
            payload_hash=payload_hash or None,
            # A result is only ever written together with status 1, but keep the invariant local.
            result=result if done else None,
            owner=owner or None,
            lease_until_ms=int(lease_until_ms) if lease_until_ms and not done else None,
            attempts=int(attempts or 1),
            created_time=_datetime(created_ms),
            processed_time=_datetime(processed_ms),
        )
    except ValueError as exc:
        raise StoreError(f"malformed idemq record for {key!r}: {values[:6]!r}") from exc
