"""What a dedup store is: a few small primitives, each atomic on the server.

Everything else (validation, hashing, JSON, units, the decision of what a claim means) lives once,
in :mod:`idemq.guard.core`. A backend only has to answer these questions atomically:

* ``claim``     — insert the record as PROCESSING for ``owner`` until ``now + lease``; if a record
  exists and is PROCESSING with an expired lease, take it over; otherwise hand back the record.
* ``complete``  — PROCESSING → PROCESSED with the result, only if ``owner`` still holds it.
* ``release``   — delete the PROCESSING record, only if ``owner`` still holds it (retry at once).

Those, with ``claim_many``, ``renew`` and ``forget``, are :class:`GuardStore`: all the guard ever
calls, and all a backend author writes to serve it. A :class:`TransactionalGuardStore` (SQL) adds
the same-transaction flavour: the claim is written as PROCESSED inside the caller's transaction,
so it commits or rolls back with the business change. What operators ask (``get``, ``find``,
``in_progress``, ``purge``, ``stats``, ``force_release``) is :class:`StoreAdmin`, apart, since
it never runs on a message's path. :class:`Store` and :class:`TransactionalStore` are the two
together: what every idemq store is. Each has an ``Async`` twin, the same methods awaited.

Times: every ``*_ms`` is integer epoch milliseconds from the guard's injected clock. A store with
a server clock (Redis, PostgreSQL, MariaDB/MySQL) sets and judges leases on that clock instead
by default (``lease_clock="store"``), taking only the lease's length from the request;
``lease_clock="client"`` makes it use the request's times, so leases are tested with a fake
clock instead of ``sleep``. SQLite and the memory store always use the guard's clock.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, runtime_checkable

from idemq.errors import ConfigurationError, StoreError

__all__ = [
    "DEFAULT_CONSUMER",
    "LEASE_CLOCKS",
    "MILLISECOND",
    "STORED_NONE",
    "UTC_EPOCH",
    "AsyncGuardStore",
    "AsyncStore",
    "AsyncStoreAdmin",
    "AsyncTransactionalGuardStore",
    "AsyncTransactionalStore",
    "Claim",
    "ClaimRequest",
    "ForgetResult",
    "GuardStore",
    "Key",
    "Record",
    "RecordStatus",
    "Store",
    "StoreAdmin",
    "StoreStats",
    "TransactionalGuardStore",
    "TransactionalStore",
    "expiry_ms",
]

DEFAULT_CONSUMER = "default"

LEASE_CLOCKS = ("store", "client")
"""The values of the SQL and Redis stores' ``lease_clock`` option: leases set and judged on the
store server's clock, or on the guard's (injected) clock."""

STORED_NONE = "null"
"""A handler's ``None`` result as stored (the guard's JSON for it): what a transactional claim
writes up front, so that a handler returning None needs no write of its result."""

UTC_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
"""Epoch milliseconds 0 as an aware datetime: ``UTC_EPOCH + MILLISECOND * ms``."""

MILLISECOND = timedelta(milliseconds=1)
"""``epoch + MILLISECOND * ms``: a stored epoch-ms time as a datetime. Exact integer arithmetic,
and the cheapest form (a third less than ``timedelta(0, 0, 0, ms)``); claims and duplicates
convert one or two per message."""


def expiry_ms(expires_after_s: float | None) -> int | None:
    """A store's ``expires_after_s`` checked, in milliseconds: None (completed records never
    expire; ``purge`` removes them) or how long after its completion a record still answers
    DUPLICATE. Past that it counts as absent and its message runs again."""
    if expires_after_s is None:
        return None
    if isinstance(expires_after_s, bool) or not isinstance(expires_after_s, int | float):
        raise ConfigurationError(f"expires_after_s must be a number, got {expires_after_s!r}")
    if not expires_after_s > 0:
        raise ConfigurationError(f"expires_after_s must be positive, got {expires_after_s!r}")
    return round(expires_after_s * 1000)


class ForgetResult(enum.StrEnum):
    """What :meth:`Store.forget` did."""

    FORGOTTEN = "forgotten"  # the record is gone: the message will run again if delivered
    NOT_FOUND = "not_found"  # there was no record
    LIVE_LEASE = "live_lease"  # refused: a worker holds a live lease on it (use force)


class RecordStatus(enum.IntEnum):
    """The ``status`` column of ``message_idempotent`` (values fixed by the seed table)."""

    PROCESSING = 0
    PROCESSED = 1


@dataclass(frozen=True, slots=True)
class Key:
    """A record's identity: message ids are scoped per consumer."""

    consumer: str
    message_id: str


@dataclass(slots=True)
class ClaimRequest:
    """Everything a store needs to claim one message; built and validated by the guard.

    Not frozen: one is built per message on the hot path, where a frozen dataclass costs three
    times as much (each field goes through ``object.__setattr__``), and it never outlives the
    guard call that built it, so nothing can share and mutate one.
    """

    key: Key
    business_id: str | None
    payload_hash: str | None
    owner: str
    now_ms: int
    lease_ms: int

    @property
    def lease_until_ms(self) -> int:
        return self.now_ms + self.lease_ms


@dataclass(slots=True)
class Record:
    """One row of ``message_idempotent`` (or its Redis/memory equivalent).

    A snapshot handed to the caller, not a live view: changing one changes nothing stored. Not
    frozen, because a duplicate's claim builds one per message, and a frozen dataclass of eleven
    fields costs four times as much to build (every field goes through ``object.__setattr__``).
    """

    consumer: str
    message_id: str
    status: RecordStatus
    business_id: str | None = None
    payload_hash: str | None = None
    result: str | None = None  # JSON text; None until PROCESSED
    owner: str | None = None
    lease_until_ms: int | None = None
    attempts: int = 1
    created_time: datetime | None = None  # aware UTC
    processed_time: datetime | None = None  # aware UTC

    @property
    def key(self) -> Key:
        return Key(self.consumer, self.message_id)

    def lease_expired(self, now_ms: int) -> bool:
        return self.lease_until_ms is not None and self.lease_until_ms <= now_ms

    def expired(self, now_ms: int, expires_after_ms: int | None) -> bool:
        """Whether this is a PROCESSED record completed more than ``expires_after_ms`` before
        ``now_ms`` (None: records never expire): on a store with ``expires_after_s``, one that
        counts as absent, so its message runs again."""
        return (
            expires_after_ms is not None
            and self.status is RecordStatus.PROCESSED
            and self.processed_time is not None
            and self.processed_time < UTC_EPOCH + MILLISECOND * (now_ms - expires_after_ms)
        )


@dataclass(frozen=True, slots=True)
class Claim:
    """The answer to a claim: either this owner now holds the message, or here is who does.

    ``fence``: a won lease-mode claim's fencing token — the store's clock in epoch microseconds
    when the claim was won (Redis ``TIME``, PostgreSQL ``statement_timestamp()``, MariaDB/MySQL
    ``UTC_TIMESTAMP(6)``; SQLite and memory: this process's clock, strictly increasing in it).
    A takeover happens only once the old lease is over on the store's clock, so its fence is
    greater than the old owner's; a claim after a release is later too, unless the server's
    clock stepped back. None for a lost claim and for claims that carry none (transactional
    batches).
    """

    acquired: bool
    record: Record | None = None  # the existing record when not acquired
    fence: int | None = None

    @classmethod
    def won(cls, fence: int | None = None) -> Claim:
        return _WON if fence is None else cls(True, None, fence)

    @classmethod
    def lost_to(cls, record: Record) -> Claim:
        return cls(False, record)  # positional: one per duplicate, keywords cost half again


_WON = Claim(acquired=True)


@dataclass(frozen=True, slots=True)
class StoreStats:
    """What an operator asks of a dedup store at 3 a.m. (``idemq stats``, the metrics gauges).

    Counts cover every consumer. ``stuck`` is the number of PROCESSING records whose lease has
    expired at ``now_ms``: a worker claimed them and neither completed nor released them (it
    crashed, or it is still running past its lease). ``size_bytes`` is the backend's own
    estimate, ``None`` where it cannot tell; ``size_method`` says how it was obtained.
    """

    processing: int
    processed: int
    stuck: int
    oldest_processing: datetime | None  # created_time of the oldest PROCESSING record (UTC)
    oldest_processed: datetime | None  # processed_time of the oldest PROCESSED record (UTC)
    size_bytes: int | None
    size_method: str
    now_ms: int  # the time ``stuck`` was judged at

    @property
    def total(self) -> int:
        """Records of either status."""
        return self.processing + self.processed


@runtime_checkable
class GuardStore(Protocol):
    """The primitives the guard calls on every message: what a backend must write.

    Each is one atomic step on the server (an ``INSERT … ON CONFLICT``, a ``SET NX PX``, one
    Lua script); everything around them (validation, hashing, the decision) is the guard's. A
    store that implements only these serves :class:`~idemq.Idempotency` in lease mode; the
    operator's tools need :class:`StoreAdmin` too.
    """

    def claim(self, request: ClaimRequest) -> Claim:
        """Take the message for ``request.owner`` (a new record, or a takeover of an expired
        lease), or hand back the record that holds it."""

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """:meth:`claim` for a batch, in one round trip where the backend can; same order."""

    def complete(self, key: Key, owner: str, result: str, now_ms: int) -> None:
        """Mark PROCESSED; raise :class:`~idemq.LeaseLostError` if ``owner`` lost the lease."""

    def release(self, key: Key, owner: str) -> None:
        """Delete the PROCESSING record if ``owner`` still holds it; otherwise do nothing."""

    def renew(self, key: Key, owner: str, lease_until_ms: int, now_ms: int) -> bool:
        """Extend ``owner``'s live claim to ``lease_until_ms``; False when ``owner`` no longer
        holds it (taken over, released, completed or gone)."""

    def forget(
        self,
        message_id: str,
        consumer: str = DEFAULT_CONSUMER,
        *,
        force: bool = False,
        now_ms: int | None = None,
    ) -> ForgetResult:
        """Delete the record of ``message_id`` so the message runs again when it is delivered.

        A PROCESSED record or an expired claim is deleted; a live lease (at ``now_ms``, default
        the store's clock) only with ``force`` — its holder may be mid-effect. Decided on the
        server, atomically: a record that changes between an operator's look and this call is
        judged as it is then."""

    def close(self) -> None:
        """Release the connections this store opened (a client or engine handed in is the
        caller's to close)."""


@runtime_checkable
class StoreAdmin(Protocol):
    """What an operator asks of a store (``idemq inspect``, ``stats``, ``purge``, the metrics
    gauges): reads and bulk deletes that never run on a message's path."""

    def get(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> Record | None:
        """The record of ``message_id`` for ``consumer``, or None."""

    def find(self, message_id: str) -> list[Record]:
        """Every consumer's record of ``message_id`` (for inspection)."""

    def in_progress(self, *, limit: int = 100) -> list[Record]:
        """PROCESSING records, oldest first (stuck leases are the expired ones)."""

    def purge(
        self, older_than: timedelta, *, batch_size: int = 1000, now_ms: int | None = None
    ) -> int:
        """Delete PROCESSED records older than ``older_than`` (relative to ``now_ms``, default
        the wall clock) in bounded batches; return how many were deleted."""

    def stats(self, *, now_ms: int | None = None) -> StoreStats:
        """Counts by status, oldest records, stuck leases at ``now_ms``, approximate size."""

    def force_release(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> bool:
        """Operator's override: delete the PROCESSING record whoever owns it; True if deleted.

        A PROCESSED record is never touched (deleting it would let the message run twice)."""


@runtime_checkable
class Store(GuardStore, StoreAdmin, Protocol):
    """A complete store: the guard's primitives and the operator's tools (every idemq store)."""


@runtime_checkable
class TransactionalGuardStore(GuardStore, Protocol):
    """The primitives of a store whose dedup row can share a transaction with the business
    change (SQL): what the guard calls in transactional mode, besides :class:`GuardStore`."""

    def transaction(self, connection: Any = None) -> AbstractContextManager[Any]:
        """Open (or join, via a savepoint) a transaction; yield the connection to write through."""

    def claim_in(self, tx: Any, request: ClaimRequest) -> Claim:
        """Insert the record as PROCESSED inside ``tx``; a concurrent twin waits on the row lock."""

    def claim_many_in(self, tx: Any, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """:meth:`claim_in` for a batch, in one statement where the backend can; same order."""

    def confirm_in(
        self, tx: Any, key: Key, owner: str, result: str, *, deferred: bool = False
    ) -> None:
        """Store ``result`` on the row ``owner`` claimed in ``tx`` and prove, right before the
        COMMIT, that ``tx`` still holds that row: raise :class:`~idemq.TransactionLostError`
        otherwise (the transaction was aborted or rolled back under a handler that caught the
        error). ``deferred``: a later :meth:`confirm_many_in` proves the row, so only what costs
        no extra statement is checked now."""

    def confirm_many_in(self, tx: Any, requests: Sequence[ClaimRequest]) -> None:
        """:meth:`confirm_in` for a batch's claimed rows at once (results already stored)."""

    def release_in(self, tx: Any, key: Key, owner: str) -> None:
        """Delete a claim made by ``claim_many_in`` whose handler failed (batch savepoints)."""

    def translate_handler_error(self, tx: Any, error: BaseException) -> StoreError | None:
        """The store error a handler's exception raised inside ``tx`` stands for when the
        transaction is gone (a deadlock rolled it back, the connection dropped), else None."""

    def begin_savepoint(self, tx: Any) -> Any:
        """A savepoint inside ``tx``, for one batch message's writes."""

    def end_savepoint(self, savepoint: Any, *, commit: bool) -> None:
        """Release ``savepoint`` (``commit``) or roll back to it; raises if the transaction is
        gone."""


@runtime_checkable
class TransactionalStore(TransactionalGuardStore, Store, Protocol):
    """A complete transactional store (SQL): :class:`TransactionalGuardStore` and
    :class:`StoreAdmin`."""


@runtime_checkable
class AsyncGuardStore(Protocol):
    """Async twin of :class:`GuardStore`: the same primitives, awaited."""

    async def claim(self, request: ClaimRequest) -> Claim: ...

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]: ...

    async def complete(self, key: Key, owner: str, result: str, now_ms: int) -> None: ...

    async def release(self, key: Key, owner: str) -> None: ...

    async def renew(self, key: Key, owner: str, lease_until_ms: int, now_ms: int) -> bool: ...

    async def forget(
        self,
        message_id: str,
        consumer: str = DEFAULT_CONSUMER,
        *,
        force: bool = False,
        now_ms: int | None = None,
    ) -> ForgetResult: ...

    async def close(self) -> None: ...


@runtime_checkable
class AsyncStoreAdmin(Protocol):
    """Async twin of :class:`StoreAdmin`."""

    async def get(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> Record | None: ...

    async def find(self, message_id: str) -> list[Record]: ...

    async def in_progress(self, *, limit: int = 100) -> list[Record]: ...

    async def purge(
        self, older_than: timedelta, *, batch_size: int = 1000, now_ms: int | None = None
    ) -> int: ...

    async def stats(self, *, now_ms: int | None = None) -> StoreStats: ...

    async def force_release(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> bool: ...


@runtime_checkable
class AsyncStore(AsyncGuardStore, AsyncStoreAdmin, Protocol):
    """Async twin of :class:`Store`."""


@runtime_checkable
class AsyncTransactionalGuardStore(AsyncGuardStore, Protocol):
    """Async twin of :class:`TransactionalGuardStore`."""

    def transaction(self, connection: Any = None) -> AbstractAsyncContextManager[Any]: ...

    async def claim_in(self, tx: Any, request: ClaimRequest) -> Claim: ...

    async def claim_many_in(self, tx: Any, requests: Sequence[ClaimRequest]) -> list[Claim]: ...

    async def confirm_in(
        self, tx: Any, key: Key, owner: str, result: str, *, deferred: bool = False
    ) -> None: ...

    async def confirm_many_in(self, tx: Any, requests: Sequence[ClaimRequest]) -> None: ...

    async def release_in(self, tx: Any, key: Key, owner: str) -> None: ...

    async def translate_handler_error(self, tx: Any, error: BaseException) -> StoreError | None: ...

    async def begin_savepoint(self, tx: Any) -> Any: ...

    async def end_savepoint(self, savepoint: Any, *, commit: bool) -> None: ...


@runtime_checkable
class AsyncTransactionalStore(AsyncTransactionalGuardStore, AsyncStore, Protocol):
    """Async twin of :class:`TransactionalStore`."""
