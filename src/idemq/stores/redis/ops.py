"""Everything :class:`~idemq.RedisStore` does, written once as sans-I/O operations.

Key layout — one string per record (its value: see :mod:`.scripts`),
``<prefix>:{<consumer>:<message_id>}``, both parts percent-encoded. Why encode: message ids are
arbitrary text. A raw ``}`` would end the Cluster hash tag early, a raw ``:`` would make
``("a:b", "c")`` and ``("a", "b:c")`` the same key, and a raw ``*``/``?``/``[`` would turn
:meth:`find`'s SCAN pattern into a wildcard that reads (or a purge that deletes) other messages'
records. After encoding, a key part holds only ``[A-Za-z0-9_.~-]`` and ``%XX``, so it is exact,
reversible and glob-inert; patterns are glob-escaped anyway as a second line of defence.

Two shapes of operation. The store protocol's primitives — claim, claim_many, complete,
release — are one script call each and run once per message, so they are plain functions: one
builds the :class:`RunScript`, one reads its reply, and the shells call the two around their
EVALSHA. The operator's tools (find, stats, purge …) take several round trips (SCAN loops) and
are generators of steps, run by :func:`~idemq._plan.drive`/``adrive``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from idemq.drivers.redis import Batch, Call, Op, RunScript
from idemq.errors import ConfigurationError, InvalidInputError, LeaseLostError, StoreError
from idemq.stores.base import (
    Claim,
    ClaimRequest,
    Key,
    Record,
    RecordStatus,
    StoreStats,
)
from idemq.stores.redis.keys import Layout
from idemq.stores.redis.records import _EPOCH, parse_record
from idemq.stores.redis.scripts import (
    CLAIM,
    CLAIM_MANY,
    COMPLETE,
    FORCE_RELEASE,
    PURGE,
    RELEASE,
)

__all__ = [
    "Layout",
    "claim_call",
    "claim_many_call",
    "claim_many_result",
    "claim_result",
    "claim_set",
    "claim_set_result",
    "complete_call",
    "complete_result",
    "find",
    "force_release",
    "get",
    "in_progress",
    "parse_record",
    "purge",
    "release_call",
    "stats",
]

_SCAN_COUNT = 1000
MEMORY_SAMPLE = 64
"""Records whose MEMORY USAGE is asked for by :func:`stats` (the size is extrapolated)."""


# Every argument of a claim, complete or release is sent as bytes, text as UTF-8: redis-py's
# encoder passes bytes through at its first type test, where a str costs it four tests and an
# encode and an int five and a repr (per argument 0.4 and 0.7 µs here, against 0.1 µs). Records
# are read back as UTF-8 (idemq.drivers.redis.text), so they are written as UTF-8 whatever
# encoding the client was configured with; keys are ASCII but for the prefix.


def _arg(value: int) -> bytes:
    """An integer as a command argument."""
    return b"%d" % value


def _claim_argv(
    layout: Layout, request: ClaimRequest
) -> tuple[bytes, bytes, bytes, bytes, bytes, bytes]:
    """The claim script's six values of ``request`` (its ARGV), as command arguments."""
    owner = request.owner
    business_id = request.business_id or ""
    payload_hash = request.payload_hash or ""
    if "\0" in owner or "\0" in business_id or "\0" in payload_hash:
        # The claim script joins a record's values with NUL; core never builds such a request.
        raise InvalidInputError("a claim's owner, business id and payload hash cannot hold NUL")
    lease_ms = request.lease_ms
    now_ms = request.now_ms
    return (
        owner.encode(),
        _arg(now_ms),
        _arg(now_ms + lease_ms),
        # Keep a PROCESSING record until its lease is over plus the retention ttl: long enough
        # that a redelivery after a crash finds it and takes over rather than starts afresh.
        _arg(lease_ms + layout.ttl_ms),
        business_id.encode(),
        payload_hash.encode(),
    )


def claim_set(layout: Layout, request: ClaimRequest) -> tuple[bytes, ...]:
    """The first try at a claim: ``SET key <PROCESSING record> NX PX gc GET`` (Redis >= 7.0).

    One native command, no script: it creates the record when there is none and otherwise
    hands back the stored one untouched — for a duplicate, the whole answer. Only a PROCESSING
    record that may be taken over needs the claim script (see :func:`claim_set_result`).
    """
    owner, now_ms, until_ms, gc_ms, business_id, payload_hash = _claim_argv(layout, request)
    # The same record the claim script writes for a fresh claim (FIELDS order, NUL-joined).
    record = b"\0".join((b"0", owner, until_ms, b"1", now_ms, b"", business_id, payload_hash, b""))
    return (b"SET", layout.key_arg(request.key), record, b"NX", b"PX", gc_ms, b"GET")


def claim_set_result(request: ClaimRequest, stored: bytes | str | None) -> Claim | None:
    """The claim that :func:`claim_set` decided, or ``None``: run :func:`claim_call` next.

    ``None`` for a PROCESSING record whose lease has expired (a takeover, if the payload
    allows) or that is already ``request.owner``'s (a replayed claim). The script judges
    those atomically, so a record that changed in between is judged as it is then.
    """
    if stored is None:
        return Claim.won()
    record = parse_record(request.key, stored)
    if record is None:  # unreachable: parse_record maps only None to None
        raise StoreError(f"unexpected claim reply for {request.key!r}: {stored!r}")
    if record.status is RecordStatus.PROCESSING and (
        record.owner == request.owner or record.lease_expired(request.now_ms)
    ):
        return None
    return Claim.lost_to(record)


def claim_call(layout: Layout, request: ClaimRequest) -> RunScript:
    """The claim script for one message; read the reply with :func:`claim_result`."""
    return RunScript(CLAIM, (layout.key_arg(request.key),), _claim_argv(layout, request))


def claim_result(key: Key, reply: Any) -> Claim:
    """Won (the script returned 1) or lost to the record it handed back."""
    if reply == 1:
        return Claim.won()
    record = parse_record(key, reply)
    if record is None:  # the script returns 1 or an existing record; anything else is a bug
        raise StoreError(f"unexpected claim reply for {key!r}: {reply!r}")
    return Claim.lost_to(record)


def claim_many_call(layout: Layout, requests: Sequence[ClaimRequest]) -> RunScript:
    """The claims of a batch in one script call (``requests`` must not be empty)."""
    keys = tuple(layout.key_arg(r.key) for r in requests)
    args = tuple(a for r in requests for a in _claim_argv(layout, r))
    return RunScript(CLAIM_MANY, keys, args)


def claim_many_result(requests: Sequence[ClaimRequest], replies: Any) -> list[Claim]:
    """The claims of :func:`claim_many_call`, in the order of ``requests``."""
    return [claim_result(r.key, reply) for r, reply in zip(requests, replies, strict=True)]


def _encode_value(value: str) -> bytes:
    # Results are JSON text from the guard; encode ourselves so even a lone surrogate round-trips.
    return value.encode("utf-8", "surrogatepass")


def complete_call(layout: Layout, key: Key, owner: str, result: str, now_ms: int) -> RunScript:
    """PROCESSING → PROCESSED for ``owner``; check the reply with :func:`complete_result`."""
    return RunScript(
        COMPLETE,
        (layout.key_arg(key),),
        (owner.encode(), _encode_value(result), _arg(now_ms), _arg(layout.ttl_ms)),
    )


def complete_result(key: Key, reply: Any) -> None:
    """Raise :class:`LeaseLostError` unless the complete script stored the result."""
    if reply != 1:
        raise LeaseLostError(
            f"lease on {key.message_id!r} (consumer {key.consumer!r}) was lost before complete: "
            "another worker took it over or it expired away; the result was not stored"
        )


def release_call(layout: Layout, key: Key, owner: str) -> RunScript:
    """Delete ``owner``'s PROCESSING record (a no-op for anyone else); the reply is unused."""
    return RunScript(RELEASE, (layout.key_arg(key),), (owner.encode(),))


def get(layout: Layout, key: Key) -> Op[Record | None]:
    stored = yield Call(("GET", layout.key(key)))
    return parse_record(key, stored)


def _scan(pattern: str) -> Op[list[bytes | str]]:
    """Every key matching ``pattern`` (SCAN may repeat keys; duplicates are dropped)."""
    found: dict[bytes | str, None] = {}
    cursor: int = 0
    while True:
        reply = yield Call(
            ("SCAN", cursor, "MATCH", pattern, "COUNT", _SCAN_COUNT, "TYPE", "string")
        )
        cursor, keys = int(reply[0]), reply[1]
        found.update(dict.fromkeys(keys))
        if cursor == 0:
            return list(found)


def _fetch(
    layout: Layout, raw_keys: Sequence[bytes | str], *, skip_malformed: bool = False
) -> Op[list[Record]]:
    """The records under ``raw_keys`` (pipelined GETs); a value that is not a record raises
    :class:`StoreError`, or is left out with ``skip_malformed`` (counting, not reading)."""
    pairs = [(raw, parsed) for raw in raw_keys if (parsed := layout.parse_key(raw)) is not None]
    records: list[Record] = []
    for start in range(0, len(pairs), _SCAN_COUNT):
        chunk = pairs[start : start + _SCAN_COUNT]
        replies = yield Batch(tuple(("GET", raw) for raw, _ in chunk))
        for (_, key), stored in zip(chunk, replies, strict=True):
            try:
                record = parse_record(key, stored)  # None: expired or deleted since the SCAN
            except StoreError:
                if not skip_malformed:
                    raise
                continue
            if record is not None:
                records.append(record)
    return records


def find(layout: Layout, message_id: str) -> Op[list[Record]]:
    raw_keys = yield from _scan(layout.pattern_message(message_id))
    records = yield from _fetch(layout, raw_keys)
    return sorted((r for r in records if r.message_id == message_id), key=lambda r: r.consumer)


def in_progress(layout: Layout, limit: int) -> Op[list[Record]]:
    raw_keys = yield from _scan(layout.pattern_all())
    records = yield from _fetch(layout, raw_keys)
    processing = [r for r in records if r.status is RecordStatus.PROCESSING]
    processing.sort(key=lambda r: (r.created_time or _EPOCH, r.lease_until_ms or 0))
    return processing[:limit]


def purge(layout: Layout, cutoff_ms: int, batch_size: int) -> Op[int]:
    if batch_size < 1:
        raise ConfigurationError(f"batch_size must be at least 1, got {batch_size}")
    deleted = 0
    cursor: int = 0
    while True:
        reply = yield Call(
            ("SCAN", cursor, "MATCH", layout.pattern_all(), "COUNT", batch_size, "TYPE", "string")
        )
        cursor, keys = int(reply[0]), [k for k in reply[1] if layout.parse_key(k) is not None]
        # Bounded batches: one Lua call never blocks the server for more than batch_size keys.
        for start in range(0, len(keys), batch_size):
            deleted += yield RunScript(PURGE, tuple(keys[start : start + batch_size]), (cutoff_ms,))
        if cursor == 0:
            return deleted


def force_release(layout: Layout, key: Key) -> Op[bool]:
    deleted = yield RunScript(FORCE_RELEASE, (layout.key(key),), ())
    return bool(deleted == 1)


def stats(layout: Layout, now_ms: int) -> Op[StoreStats]:
    """Counts by SCAN + pipelined GET (O(records): an operator's tool, not a hot path).

    The size is estimated: the mean ``MEMORY USAGE`` of up to :data:`MEMORY_SAMPLE` records,
    spread over the key space, times the number of records.
    """
    raw_keys = yield from _scan(layout.pattern_all())
    keys = [raw for raw in raw_keys if layout.parse_key(raw) is not None]
    records = yield from _fetch(layout, keys, skip_malformed=True)
    processing = [r for r in records if r.status is RecordStatus.PROCESSING]
    processed = [r for r in records if r.status is RecordStatus.PROCESSED]
    stuck = sum(1 for r in processing if r.lease_expired(now_ms))
    sample = keys[:: max(1, len(keys) // MEMORY_SAMPLE)][:MEMORY_SAMPLE]
    sizes: list[int] = []
    if sample:
        usages = yield Batch(tuple(("MEMORY", "USAGE", raw) for raw in sample))
        sizes = [int(u) for u in usages if u is not None]
    count = len(records)
    size = round(sum(sizes) / len(sizes) * count) if sizes else 0
    return StoreStats(
        processing=len(processing),
        processed=len(processed),
        stuck=stuck,
        oldest_processing=min((r.created_time for r in processing if r.created_time), default=None),
        oldest_processed=min(
            (r.processed_time for r in processed if r.processed_time), default=None
        ),
        size_bytes=size,
        size_method=(
            f"redis MEMORY USAGE of {len(sizes)} sampled records x {count} records (estimate)"
        ),
        now_ms=now_ms,
    )
