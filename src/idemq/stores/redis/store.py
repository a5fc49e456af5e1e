"""Redis lease store: :class:`RedisStore` and :class:`AsyncRedisStore`.

For consumers whose effect is not in one SQL database (an HTTP call, another service). A claim
is the seed's "lock + processed?" in **one** atomic round trip, so no separate lock is needed,
and a duplicate gets the stored record back from that same call::

    claim     absent            → PROCESSING(owner, lease_until)          won
              PROCESSING, live  → the record                              lost (IN_PROGRESS)
              PROCESSING, expired lease, same payload → new owner, a += 1 won (takeover)
              PROCESSED         → the record with its result              lost (DUPLICATE)
    complete  PROCESSING(owner) → PROCESSED(result), PX ttl               else LeaseLostError
    release   PROCESSING(owner) → deleted                                 else no-op

The claim is a native ``SET key <record> NX PX gc GET`` (Redis >= 7.0): it writes a fresh
claim or hands back the stored record, untouched, in one command. Only a PROCESSING record
whose lease has expired (a crashed worker's) needs judging under the lock of a script: that
takeover is a second round trip, the claim script, which re-reads the record and decides
atomically. complete and release are one script call each; claim_many is one script call for
the batch.

Leases are set and judged on Redis's clock (``TIME``, read inside the scripts) by default, so
workers whose clocks disagree still agree on whether a lease is live; with that clock every
claim is the claim script (one round trip, fresh or duplicate). ``lease_clock="client"`` judges
leases on the guard's clock instead (``now_ms``/``lease_until_ms`` in the request, the native
``SET … NX PX … GET`` fast path): the fake-clock contract tests use it, and across hosts it makes
a lease only as good as the workers' clock agreement.

Both classes are thin shells: every operation is a plan of :mod:`.ops` (keys, records, scripts
and reply parsing live there and below), and the two stores differ only in the executor of
:mod:`idemq.drivers.redis` that carries the plan out. A primitive that is one script call
whatever it finds (complete, release, and the claim on Redis's clock or a Cluster) is that call,
built and read by :mod:`.ops`, made without running a plan around it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import redis
import redis.asyncio

from idemq._clock import Clock, system_clock_ms
from idemq._plan import adrive, drive
from idemq.drivers.redis import (
    DEFAULT_SOCKET_TIMEOUT_S,
    AnyAsyncRedis,
    AnyRedis,
    AsyncRedisExecutor,
    RedisExecutor,
    redis_client,
    require_utf8,
)
from idemq.errors import ConfigurationError
from idemq.stores.base import (
    DEFAULT_CONSUMER,
    LEASE_CLOCKS,
    Claim,
    ClaimRequest,
    ForgetResult,
    Key,
    Record,
    StoreStats,
)
from idemq.stores.redis import ops

__all__ = ["DEFAULT_SOCKET_TIMEOUT_S", "DEFAULT_TTL_S", "AsyncRedisStore", "RedisStore"]

DEFAULT_TTL_S = 86_400.0
"""How long a PROCESSED record is kept (and so how long a duplicate is recognised): one day."""


class _RedisStoreBase:
    """What the sync and the async Redis store share: layout, clock and naming."""

    _layout: ops.Layout
    _clock: Clock
    _server: str
    _owns_client: bool
    _server_clock: bool
    _claim_is_script: bool

    def _configure(
        self,
        client_or_url: Any,
        ttl_s: float,
        prefix: str,
        clock: Clock | None,
        lease_clock: str,
    ) -> None:
        self._layout = ops.Layout.build(prefix, ttl_s)
        self._clock = clock or system_clock_ms
        self._owns_client = isinstance(client_or_url, str)
        if lease_clock not in LEASE_CLOCKS:
            raise ConfigurationError(
                f"lease_clock must be one of {', '.join(map(repr, LEASE_CLOCKS))}, "
                f"got {lease_clock!r}"
            )
        self._server_clock = lease_clock == "store"

    @property
    def lease_clock(self) -> str:
        """Whose clock sets and judges leases: ``"store"`` (Redis's) or ``"client"``."""
        return "store" if self._server_clock else "client"

    def _judged_at(self, now_ms: int | None) -> int | None:
        """The time ``stats``/``forget`` judge leases at: on Redis's clock None (the server
        reads its own), else ``now_ms`` or the store's ``clock``."""
        if self._server_clock:
            return None
        return self._clock() if now_ms is None else now_ms

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._server}, prefix={self._layout.prefix!r})"

    @property
    def prefix(self) -> str:
        """The key namespace of this store's records."""
        return self._layout.prefix


class RedisStore(_RedisStoreBase):
    """Lease-mode dedup store on Redis (one string per record, one round trip per primitive).

    ``client_or_url``: a ``redis.Redis`` or ``redis.cluster.RedisCluster`` (shared, not closed
    by :meth:`close`) or a ``redis://``/``rediss://``/``unix://`` URL (the store owns that
    client, built with ``socket_timeout_s``; ``redis://host:port?cluster=true`` for a Redis
    Cluster). ``ttl_s``: how long a PROCESSED record, and so duplicate detection,
    lasts. ``prefix``: key namespace. ``lease_clock``: whose clock sets and judges leases —
    ``"store"`` (default: Redis's ``TIME``, so workers' clock skew cannot end a live lease;
    ``stats``/``forget`` then judge at Redis's now and ignore ``now_ms``) or ``"client"`` (the
    guard's injected clock, for fake-clock tests). ``clock``: epoch-ms clock of :meth:`purge`
    (and, with ``lease_clock="client"``, of :meth:`stats` and :meth:`forget`).
    """

    def __init__(
        self,
        client_or_url: AnyRedis | str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        prefix: str = "idemq",
        clock: Clock | None = None,
        socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
        lease_clock: str = "store",
    ) -> None:
        self._configure(client_or_url, ttl_s, prefix, clock, lease_clock)
        self._client = redis_client(client_or_url, redis.Redis, socket_timeout_s=socket_timeout_s)
        require_utf8(self._client, type(self).__name__)
        self._execute = RedisExecutor(self._client)
        self._server = self._execute.server
        self._claim_many_op = ops.claim_many_by_slot if self._execute.cluster else ops.claim_many
        # On Redis's clock or a Cluster a claim is the claim script whatever it finds (see
        # ops.claim), decided once here.
        self._claim_is_script = self._server_clock or self._execute.cluster

    @property
    def client(self) -> AnyRedis:
        """The underlying redis-py client (for tests and ops)."""
        return self._client

    def claim(self, request: ClaimRequest) -> Claim:
        """Claim one message; see the module docstring for the outcomes."""
        if self._claim_is_script:  # the claim plan would be this one call
            step = ops.claim_script(self._layout, request, server_clock=self._server_clock)
            return ops.claimed(request.key, self._execute(step))
        return drive(ops.claim(self._layout, request), self._execute)

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim a batch in one Lua call (on a Cluster, one per hash slot); the answers come
        back in order."""
        return drive(
            self._claim_many_op(self._layout, requests, server_clock=self._server_clock),
            self._execute,
        )

    def complete(self, key: Key, owner: str, result: str, now_ms: int) -> None:
        """PROCESSING → PROCESSED; raises :class:`~idemq.LeaseLostError` if ``owner`` lost it."""
        step = ops.complete_script(
            self._layout, key, owner, result, now_ms, server_clock=self._server_clock
        )
        ops.completed(key, self._execute(step))

    def release(self, key: Key, owner: str) -> None:
        """Delete ``owner``'s PROCESSING record so the message can be retried; else no-op."""
        self._execute(ops.release_script(self._layout, key, owner))

    def renew(self, key: Key, owner: str, lease_until_ms: int, now_ms: int) -> bool:
        """Extend ``owner``'s lease to ``lease_until_ms``; False when ``owner`` lost the claim."""
        op = ops.renew(
            self._layout, key, owner, lease_until_ms, now_ms, server_clock=self._server_clock
        )
        return drive(op, self._execute)

    def get(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> Record | None:
        """The record of ``message_id`` for ``consumer``, or ``None``."""
        return drive(ops.get(self._layout, Key(consumer, message_id)), self._execute)

    def find(self, message_id: str) -> list[Record]:
        """Every consumer's record of ``message_id`` (SCAN: for inspection, not hot paths)."""
        return drive(ops.find(self._layout, message_id), self._execute)

    def in_progress(self, *, limit: int = 100) -> list[Record]:
        """PROCESSING records, oldest first (SCAN over the prefix: for ops use)."""
        return drive(ops.in_progress(self._layout, limit), self._execute)

    def purge(
        self, older_than: timedelta, *, batch_size: int = 1000, now_ms: int | None = None
    ) -> int:
        """Delete PROCESSED records older than ``older_than`` at ``now_ms`` (default: the
        store's clock), SCAN + one Lua call per ``batch_size`` keys; they also expire by ttl."""
        cutoff_ms = _cutoff_ms(self._clock if now_ms is None else now_ms, older_than)
        op = ops.purge(self._layout, cutoff_ms, batch_size, by_slot=self._execute.cluster)
        return drive(op, self._execute)

    def stats(self, *, now_ms: int | None = None) -> StoreStats:
        """Counts, oldest records, stuck leases (at ``now_ms``, default the store's clock) and
        an estimated size; SCANs the prefix, so it is for ops, not hot paths."""
        return drive(ops.stats(self._layout, self._judged_at(now_ms)), self._execute)

    def force_release(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> bool:
        """Delete the PROCESSING record whoever owns it (never a PROCESSED one); True if done."""
        return drive(ops.force_release(self._layout, Key(consumer, message_id)), self._execute)

    def forget(
        self,
        message_id: str,
        consumer: str = DEFAULT_CONSUMER,
        *,
        force: bool = False,
        now_ms: int | None = None,
    ) -> ForgetResult:
        """See :meth:`idemq.stores.base.GuardStore.forget` (one Lua call)."""
        key = Key(consumer, message_id)
        op = ops.forget(self._layout, key, force=force, now_ms=self._judged_at(now_ms))
        return drive(op, self._execute)

    def close(self) -> None:
        """Close the client if this store created it from a URL."""
        if self._owns_client:
            self._client.close()


class AsyncRedisStore(_RedisStoreBase):
    """Async twin of :class:`RedisStore` (``redis.asyncio.Redis``, its ``RedisCluster`` or a
    URL); same primitives."""

    def __init__(
        self,
        client_or_url: AnyAsyncRedis | str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        prefix: str = "idemq",
        clock: Clock | None = None,
        socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
        lease_clock: str = "store",
    ) -> None:
        self._configure(client_or_url, ttl_s, prefix, clock, lease_clock)
        self._client = redis_client(
            client_or_url, redis.asyncio.Redis, socket_timeout_s=socket_timeout_s
        )
        require_utf8(self._client, type(self).__name__)
        self._execute = AsyncRedisExecutor(self._client)
        self._server = self._execute.server
        self._claim_many_op = ops.claim_many_by_slot if self._execute.cluster else ops.claim_many
        # On Redis's clock or a Cluster a claim is the claim script whatever it finds (see
        # ops.claim), decided once here.
        self._claim_is_script = self._server_clock or self._execute.cluster

    @property
    def client(self) -> AnyAsyncRedis:
        """The underlying redis-py asyncio client (for tests and ops)."""
        return self._client

    async def claim(self, request: ClaimRequest) -> Claim:
        """See :meth:`RedisStore.claim`."""
        if self._claim_is_script:  # the claim plan would be this one call
            step = ops.claim_script(self._layout, request, server_clock=self._server_clock)
            return ops.claimed(request.key, await self._execute(step))
        return await adrive(ops.claim(self._layout, request), self._execute)

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """See :meth:`RedisStore.claim_many`."""
        return await adrive(
            self._claim_many_op(self._layout, requests, server_clock=self._server_clock),
            self._execute,
        )

    async def complete(self, key: Key, owner: str, result: str, now_ms: int) -> None:
        """See :meth:`RedisStore.complete`."""
        step = ops.complete_script(
            self._layout, key, owner, result, now_ms, server_clock=self._server_clock
        )
        ops.completed(key, await self._execute(step))

    async def release(self, key: Key, owner: str) -> None:
        """See :meth:`RedisStore.release`."""
        await self._execute(ops.release_script(self._layout, key, owner))

    async def renew(self, key: Key, owner: str, lease_until_ms: int, now_ms: int) -> bool:
        """See :meth:`RedisStore.renew`."""
        op = ops.renew(
            self._layout, key, owner, lease_until_ms, now_ms, server_clock=self._server_clock
        )
        return await adrive(op, self._execute)

    async def get(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> Record | None:
        """See :meth:`RedisStore.get`."""
        return await adrive(ops.get(self._layout, Key(consumer, message_id)), self._execute)

    async def find(self, message_id: str) -> list[Record]:
        """See :meth:`RedisStore.find`."""
        return await adrive(ops.find(self._layout, message_id), self._execute)

    async def in_progress(self, *, limit: int = 100) -> list[Record]:
        """See :meth:`RedisStore.in_progress`."""
        return await adrive(ops.in_progress(self._layout, limit), self._execute)

    async def purge(
        self, older_than: timedelta, *, batch_size: int = 1000, now_ms: int | None = None
    ) -> int:
        """See :meth:`RedisStore.purge`."""
        cutoff_ms = _cutoff_ms(self._clock if now_ms is None else now_ms, older_than)
        op = ops.purge(self._layout, cutoff_ms, batch_size, by_slot=self._execute.cluster)
        return await adrive(op, self._execute)

    async def stats(self, *, now_ms: int | None = None) -> StoreStats:
        """See :meth:`RedisStore.stats`."""
        return await adrive(ops.stats(self._layout, self._judged_at(now_ms)), self._execute)

    async def force_release(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> bool:
        """See :meth:`RedisStore.force_release`."""
        key = Key(consumer, message_id)
        return await adrive(ops.force_release(self._layout, key), self._execute)

    async def forget(
        self,
        message_id: str,
        consumer: str = DEFAULT_CONSUMER,
        *,
        force: bool = False,
        now_ms: int | None = None,
    ) -> ForgetResult:
        """See :meth:`RedisStore.forget`."""
        key = Key(consumer, message_id)
        op = ops.forget(self._layout, key, force=force, now_ms=self._judged_at(now_ms))
        return await adrive(op, self._execute)

    async def close(self) -> None:
        """Close the client if this store created it from a URL."""
        if self._owns_client:
            await self._client.aclose()


def _cutoff_ms(now: Clock | int, older_than: timedelta) -> int:
    now_ms = now if isinstance(now, int) else now()
    return now_ms - older_than // timedelta(milliseconds=1)
