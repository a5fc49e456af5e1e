"""Everything :class:`~idemq.RedisStore` does, written once as sans-I/O operations.

Each operation is a generator of :mod:`idemq.drivers.redis` steps (a command, a script call, a
pipeline) run by :func:`~idemq._plan.drive` or ``adrive``, so the sync and the async store
differ only in their executor. Keys are laid out by :mod:`.keys`, records read and written by
:mod:`.records`, and the scripts live in :mod:`.scripts`.

The store protocol's primitives are one round trip each: a claim is the claim script on Redis's
clock (``server_clock``, the store's default), or ``SET … NX PX … GET`` on the guard's clock
(a takeover adds the claim script), complete and release one script each, claim_many one
script for the whole batch. The operator's tools (find, stats, purge …) are SCAN loops.

On a Redis Cluster every record is in the slot of its own hash tag (consumer and message id),
so a one-key script runs where redis-py routes it; :func:`claim_many_by_slot` and
:func:`purge` with ``by_slot`` split their keys into one script call per slot, and the SCAN
loops visit every master.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from idemq.drivers.redis import Batch, Call, Op, Primaries, RunScript, ScanPage, group_by_slot, text
from idemq.errors import ConfigurationError, InvalidInputError, LeaseLostError, StoreError
from idemq.stores.base import (
    Claim,
    ClaimRequest,
    ForgetResult,
    Key,
    Record,
    RecordStatus,
    StoreStats,
)
from idemq.stores.redis.keys import Layout
from idemq.stores.redis.records import EPOCH, format_record, parse_record
from idemq.stores.redis.scripts import (
    CLAIM,
    CLAIM_MANY,
    COMPLETE,
    FORCE_RELEASE,
    FORGET,
    PURGE,
    RELEASE,
    RENEW,
)

__all__ = [
    "Layout",
    "claim",
    "claim_many",
    "claim_many_by_slot",
    "claim_script",
    "claim_set",
    "claimed",
    "complete",
    "complete_script",
    "completed",
    "find",
    "force_release",
    "forget",
    "get",
    "in_progress",
    "purge",
    "release",
    "release_script",
    "renew",
    "server_time_ms",
    "stats",
]

_SCAN_COUNT = 1000
MEMORY_SAMPLE = 64
"""Records whose MEMORY USAGE is asked for by :func:`stats` (the size is extrapolated)."""


class ClaimArgs(NamedTuple):
    """The claim script's ARGV for one message, in order (see :data:`.scripts.CLAIM`)."""

    owner: str
    now_ms: int | str  # '' = Redis's clock (the script reads TIME)
    lease_ms: int
    gc_ms: int
    business_id: str
    payload_hash: str


def _claim_args(layout: Layout, request: ClaimRequest, server_clock: bool) -> ClaimArgs:
    owner = request.owner
    business_id = request.business_id or ""
    payload_hash = request.payload_hash or ""
    if "\0" in owner or "\0" in business_id or "\0" in payload_hash:
        # NUL separates a record's values; the guard never builds such a request.
        raise InvalidInputError("a claim's owner, business id and payload hash cannot hold NUL")
    return ClaimArgs(
        owner=owner,
        now_ms="" if server_clock else request.now_ms,
        lease_ms=request.lease_ms,
        # Keep a PROCESSING record until its lease is over plus the retention ttl: long enough
        # that a redelivery after a crash finds it and takes over rather than starts afresh.
        gc_ms=request.lease_ms + layout.ttl_ms,
        business_id=business_id,
        payload_hash=payload_hash,
    )


def claim_set(layout: Layout, request: ClaimRequest) -> Call:
    """The first try at a claim: ``SET key <PROCESSING record> NX PX gc GET`` (Redis >= 7.0).

    One native command, no script: it creates the record when there is none and otherwise
    hands back the stored one untouched; for a duplicate, that is the whole answer.
    """
    return _set_if_absent(layout.key(request.key), _claim_args(layout, request, False), request)


def _set_if_absent(key: str, args: ClaimArgs, request: ClaimRequest) -> Call:
    record = format_record(
        status=RecordStatus.PROCESSING,
        owner=args.owner,
        lease_until_ms=request.lease_until_ms,
        attempts=1,
        created_ms=request.now_ms,
        processed_ms=None,
        business_id=args.business_id,
        payload_hash=args.payload_hash,
        result=None,
    )
    return Call("set", key, record, nx=True, px=args.gc_ms, get=True)


def _judge_stored(request: ClaimRequest, stored: bytes | str) -> Claim | None:
    """The claim that :func:`claim_set`'s reply decides, or ``None``: ask the claim script.

    ``None`` for a PROCESSING record whose lease has expired (a takeover, if the payload
    allows) or that is already ``request.owner``'s (a replayed claim). The script judges
    those atomically, so a record that changed in between is judged as it is then.
    """
    record = parse_record(request.key, stored)
    if record is None:  # unreachable: parse_record maps only None to None
        raise StoreError(f"unexpected claim reply for {request.key!r}: {stored!r}")
    if record.status is RecordStatus.PROCESSING and (
        record.owner == request.owner or record.lease_expired(request.now_ms)
    ):
        return None
    return Claim.lost_to(record)


def claim_script(layout: Layout, request: ClaimRequest, *, server_clock: bool) -> RunScript:
    """The claim script's call for ``request`` (on Redis's clock with ``server_clock``); its
    reply means what :func:`claimed` says.

    The whole claim when it is one script call whatever it finds (on Redis's clock, or on a
    Cluster): a store makes that call itself, without running the :func:`claim` plan.
    """
    return RunScript(CLAIM, (layout.key(request.key),), _claim_args(layout, request, server_clock))


def claimed(key: Key, reply: Any) -> Claim:
    """Won (the claim script returned ``{1, fence}``) or lost to the record it handed back."""
    if isinstance(reply, list) and len(reply) == 2 and reply[0] == 1:
        return Claim.won(int(reply[1]))
    record = parse_record(key, reply)
    if record is None:  # the script returns 1 or an existing record; anything else is a bug
        raise StoreError(f"unexpected claim reply for {key!r}: {reply!r}")
    return Claim.lost_to(record)


def claim(
    layout: Layout, request: ClaimRequest, *, server_clock: bool = False, cluster: bool = False
) -> Op[Claim]:
    """Claim one message: on Redis's clock (``server_clock``) one script call whatever it
    finds; on the guard's, a fresh claim or a duplicate in one round trip, a takeover in two.
    On a Redis Cluster (``cluster``) always the script: a cluster pipeline cannot carry the
    ``TIME`` a fresh claim's fence is read from."""
    if server_clock or cluster:
        step = claim_script(layout, request, server_clock=server_clock)
        return claimed(request.key, (yield step))
    key = layout.key(request.key)
    args = _claim_args(layout, request, server_clock)
    # The fence of a fresh claim is Redis's TIME, read in the same round trip.
    stored, (seconds, micros) = yield Batch((_set_if_absent(key, args, request), Call("time")))
    if stored is None:
        return Claim.won(int(seconds) * 1_000_000 + int(micros))
    decided = _judge_stored(request, stored)
    if decided is not None:
        return decided
    reply = yield RunScript(CLAIM, (key,), args)
    return claimed(request.key, reply)


def claim_many(
    layout: Layout, requests: Sequence[ClaimRequest], *, server_clock: bool = False
) -> Op[list[Claim]]:
    """The claims of a batch in one script call, in the order of ``requests``."""
    if not requests:
        return []
    keys = tuple(layout.key(r.key) for r in requests)
    args = tuple(value for r in requests for value in _claim_args(layout, r, server_clock))
    replies = yield RunScript(CLAIM_MANY, keys, args)
    return [claimed(r.key, reply) for r, reply in zip(requests, replies, strict=True)]


def claim_many_by_slot(
    layout: Layout, requests: Sequence[ClaimRequest], *, server_clock: bool = False
) -> Op[list[Claim]]:
    """:func:`claim_many` on a Redis Cluster: one script call per hash slot of the batch (a
    script may only touch keys of one slot), the answers put back in the order of
    ``requests``."""
    claims: list[Claim | None] = [None] * len(requests)
    for positions in group_by_slot([layout.key(r.key) for r in requests]):
        answers = yield from claim_many(
            layout, [requests[p] for p in positions], server_clock=server_clock
        )
        for position, answer in zip(positions, answers, strict=True):
            claims[position] = answer
    return [c for c in claims if c is not None]


def complete(
    layout: Layout, key: Key, owner: str, result: str, now_ms: int, *, server_clock: bool = False
) -> Op[None]:
    """PROCESSING → PROCESSED for ``owner`` (stamped ``now_ms``, or Redis's time with
    ``server_clock``); :class:`LeaseLostError` if ``owner`` lost it."""
    step = complete_script(layout, key, owner, result, now_ms, server_clock=server_clock)
    completed(key, (yield step))


def complete_script(
    layout: Layout, key: Key, owner: str, result: str, now_ms: int, *, server_clock: bool
) -> RunScript:
    """The one call :func:`complete` is (a store makes it itself); :func:`completed` reads the
    reply."""
    # The one argument idemq encodes itself: a result is JSON text from the guard and may hold a
    # lone surrogate (json.dumps("\udcff", ensure_ascii=False)), which redis-py's strict UTF-8
    # encoder refuses. Sent as bytes with surrogatepass it round-trips, as text() reads it back.
    encoded = result.encode("utf-8", "surrogatepass")
    stamp = "" if server_clock else now_ms
    return RunScript(COMPLETE, (layout.key(key),), (owner, encoded, stamp, layout.ttl_ms))


def completed(key: Key, reply: Any) -> None:
    """What the complete script's reply means: done, or :class:`LeaseLostError`."""
    if reply != 1:
        raise LeaseLostError(
            f"lease on {key.message_id!r} (consumer {key.consumer!r}) was lost before complete: "
            "another worker took it over or it expired away; the result was not stored"
        )


def renew(
    layout: Layout,
    key: Key,
    owner: str,
    lease_until_ms: int,
    now_ms: int,
    *,
    server_clock: bool = False,
) -> Op[bool]:
    """Extend ``owner``'s lease to ``lease_until_ms`` (with ``server_clock``: to Redis's now
    plus ``lease_until_ms - now_ms``); False when ``owner`` lost the claim."""
    lease_ms = max(lease_until_ms - now_ms, 1)
    until: int | str = "" if server_clock else lease_until_ms
    args = (owner, until, lease_ms + layout.ttl_ms, lease_ms)
    reply = yield RunScript(RENEW, (layout.key(key),), args)
    return bool(reply == 1)


def release(layout: Layout, key: Key, owner: str) -> Op[None]:
    """Delete ``owner``'s PROCESSING record (a no-op for anyone else)."""
    yield release_script(layout, key, owner)


def release_script(layout: Layout, key: Key, owner: str) -> RunScript:
    """The one call :func:`release` is (a store makes it itself); its reply means nothing."""
    return RunScript(RELEASE, (layout.key(key),), (owner,))


def get(layout: Layout, key: Key) -> Op[Record | None]:
    """The record of ``key``, or ``None``."""
    stored = yield Call("get", layout.key(key))
    return parse_record(key, stored)


def _scan(pattern: str) -> Op[list[bytes | str]]:
    """Every key matching ``pattern`` on every master (SCAN may repeat keys; duplicates are
    dropped)."""
    found: dict[bytes | str, None] = {}
    for node in (yield Primaries()):
        cursor = 0
        while True:
            cursor, keys = yield ScanPage(node, cursor, pattern, _SCAN_COUNT, "string")
            found.update(dict.fromkeys(keys))
            if cursor == 0:
                break
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
        replies = yield Batch(tuple(Call("get", raw) for raw, _ in chunk))
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
    """Every consumer's record of ``message_id``, by consumer."""
    raw_keys = yield from _scan(layout.pattern_message(message_id))
    records = yield from _fetch(layout, raw_keys)
    return sorted((r for r in records if r.message_id == message_id), key=lambda r: r.consumer)


def in_progress(layout: Layout, limit: int) -> Op[list[Record]]:
    """Up to ``limit`` PROCESSING records, oldest first."""
    raw_keys = yield from _scan(layout.pattern_all())
    records = yield from _fetch(layout, raw_keys)
    processing = [r for r in records if r.status is RecordStatus.PROCESSING]
    processing.sort(key=lambda r: (r.created_time or EPOCH, r.lease_until_ms or 0))
    return processing[:limit]


def purge(layout: Layout, cutoff_ms: int, batch_size: int, *, by_slot: bool = False) -> Op[int]:
    """Delete PROCESSED records processed before ``cutoff_ms`` on every master; how many were
    deleted. ``by_slot`` (a Cluster): one script call per hash slot of each SCAN page."""
    if batch_size < 1:
        raise ConfigurationError(f"batch_size must be at least 1, got {batch_size}")
    deleted = 0
    for node in (yield Primaries()):
        cursor = 0
        while True:
            cursor, found = yield ScanPage(node, cursor, layout.pattern_all(), batch_size, "string")
            keys = [k for k in found if layout.parse_key(k) is not None]
            for chunk in _purge_chunks(keys, batch_size, by_slot=by_slot):
                deleted += yield RunScript(PURGE, chunk, (cutoff_ms,))
            if cursor == 0:
                break
    return deleted


def _purge_chunks(
    keys: list[bytes | str], batch_size: int, *, by_slot: bool
) -> list[tuple[bytes | str, ...]]:
    """``keys`` in script-sized chunks: at most ``batch_size`` keys (one Lua call never blocks
    the server for longer), and with ``by_slot`` all of one hash slot."""
    groups = [list(range(len(keys)))]
    if by_slot:
        groups = group_by_slot([text(k) for k in keys])
    return [
        tuple(keys[p] for p in group[start : start + batch_size])
        for group in groups
        for start in range(0, len(group), batch_size)
    ]


def force_release(layout: Layout, key: Key) -> Op[bool]:
    """Delete ``key``'s PROCESSING record whoever owns it; True if one was deleted."""
    deleted = yield RunScript(FORCE_RELEASE, (layout.key(key),), ())
    return bool(deleted == 1)


def forget(layout: Layout, key: Key, *, force: bool, now_ms: int | None) -> Op[ForgetResult]:
    """Delete ``key``'s record unless it is a live lease at ``now_ms`` (None: Redis's clock)
    or ``force``."""
    now: int | str = "" if now_ms is None else now_ms
    reply = yield RunScript(FORGET, (layout.key(key),), (now, "1" if force else "0"))
    return {1: ForgetResult.FORGOTTEN, 0: ForgetResult.NOT_FOUND}.get(
        int(reply), ForgetResult.LIVE_LEASE
    )


def server_time_ms() -> Op[int]:
    """Redis's clock (``TIME``) in epoch milliseconds."""
    seconds, micros = yield Call("time")
    return int(seconds) * 1000 + int(micros) // 1000


def stats(layout: Layout, now_ms: int | None) -> Op[StoreStats]:
    """Counts by SCAN + pipelined GET (O(records): an operator's tool, not a hot path); stuck
    leases judged at ``now_ms`` (None: Redis's clock, read first).

    The size is estimated: the mean ``MEMORY USAGE`` of up to :data:`MEMORY_SAMPLE` records,
    spread over the key space, times the number of records.
    """
    if now_ms is None:
        now_ms = yield from server_time_ms()
    raw_keys = yield from _scan(layout.pattern_all())
    keys = [raw for raw in raw_keys if layout.parse_key(raw) is not None]
    records = yield from _fetch(layout, keys, skip_malformed=True)
    processing = [r for r in records if r.status is RecordStatus.PROCESSING]
    processed = [r for r in records if r.status is RecordStatus.PROCESSED]
    stuck = sum(1 for r in processing if r.lease_expired(now_ms))
    sample = keys[:: max(1, len(keys) // MEMORY_SAMPLE)][:MEMORY_SAMPLE]
    sizes: list[int] = []
    if sample:
        usages = yield Batch(tuple(Call("memory_usage", raw) for raw in sample))
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
