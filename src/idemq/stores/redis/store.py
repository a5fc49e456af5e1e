"""Redis lease store: :class:`RedisStore` and :class:`AsyncRedisStore`.

For consumers whose effect is not in one SQL database (an HTTP call, another service). A claim
is the seed's "lock + processed?" in **one** atomic round trip — so no separate lock is needed
— and a duplicate gets the stored record back from that same call::

    claim     absent            → PROCESSING(owner, lease_until)          won
              PROCESSING, live  → the record                              lost (IN_PROGRESS)
              PROCESSING, expired lease, same payload → new owner, a += 1 won (takeover)
              PROCESSED         → the record with its result              lost (DUPLICATE)
    complete  PROCESSING(owner) → PROCESSED(result), PX ttl               else LeaseLostError
    release   PROCESSING(owner) → deleted                                 else no-op

The claim is a native ``SET key <record> NX PX gc GET`` (Redis >= 7.0): it writes a fresh
claim or hands back the stored record, untouched, in one command the server runs as fast as a
bare ``SET NX`` — a Lua call costs several times that. Only a PROCESSING record whose lease has
expired (a crashed worker's) needs judging under the lock of a script: that takeover is a
second round trip, the claim script, which re-reads the record and decides atomically.
complete and release are one script call each; claim_many is one script call for the batch.

Lease expiry is judged on the guard's clock (``now_ms``/``lease_until_ms`` in the request), so
the fake-clock contract tests run unchanged on SQL and Redis. Across hosts that makes the lease
as good as the workers' clock agreement: keep ``lease_s`` well above the expected skew.

Both classes are thin shells: the scripts live in :mod:`.scripts`, the operations (key
layout, arguments, reply parsing, SCAN loops) in :mod:`.ops`; a shell only executes. It
sends EVALSHA itself (the script's SHA-1 is known up front) and loads a script only when the
server answers NOSCRIPT — after a restart, a ``SCRIPT FLUSH`` or a failover.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import redis
import redis.asyncio
from redis import exceptions as rx

from idemq._clock import Clock, system_clock_ms
from idemq._plan import adrive, drive
from idemq.drivers.redis import (
    Batch,
    Call,
    RunScript,
    Step,
    check_url,
    describe_server,
    evalsha_argv,
    redact_url,
    translate_error,
)
from idemq.errors import ConfigurationError
from idemq.stores.base import DEFAULT_CONSUMER, Claim, ClaimRequest, Key, Record, StoreStats
from idemq.stores.redis import ops

__all__ = ["DEFAULT_TTL_S", "AsyncRedisStore", "RedisStore"]

DEFAULT_TTL_S = 86_400.0
"""How long a PROCESSED record is kept (and so how long a duplicate is recognised): one day."""

DEFAULT_SOCKET_TIMEOUT_S = 5.0
"""For clients idemq builds from a URL: a hung server becomes StoreUnavailableError, not a hang."""


def _from_url(factory: Any, url: str, socket_timeout_s: float) -> Any:
    check_url(url)
    try:
        return factory(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
        )
    except ValueError as exc:
        raise ConfigurationError(f"invalid Redis URL {redact_url(url)}: {exc}") from exc


class _RedisStoreBase:
    """What the sync and the async Redis store share: layout, clock, client and naming."""

    _layout: ops.Layout
    _clock: Clock
    _server: str
    _owns_client: bool

    def _connect(  # noqa: PLR0917 - private; mirrors the public constructors
        self,
        client_or_url: Any,
        client_type: type[Any],
        ttl_s: float,
        prefix: str,
        clock: Clock | None,
        socket_timeout_s: float,
    ) -> Any:
        """The client to use: built from a URL (then owned and closed by the store) or given."""
        self._layout = ops.Layout.build(prefix, ttl_s)
        self._clock = clock or system_clock_ms
        if isinstance(client_or_url, str):
            client = _from_url(client_type.from_url, client_or_url, socket_timeout_s)
            self._owns_client = True
        elif isinstance(client_or_url, client_type):
            client = client_or_url
            self._owns_client = False
        else:
            raise ConfigurationError(
                f"{type(self).__name__} needs a {client_type.__module__}.{client_type.__name__} "
                f"or a URL, got {type(client_or_url).__name__}"
            )
        self._server = describe_server(client.connection_pool.connection_kwargs)
        return client

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._server}, prefix={self._layout.prefix!r})"

    @property
    def prefix(self) -> str:
        """The key namespace of this store's records."""
        return self._layout.prefix


class RedisStore(_RedisStoreBase):
    """Lease-mode dedup store on Redis (one string per record, one round trip per primitive).

    ``client_or_url``: a ``redis.Redis`` (shared, not closed by :meth:`close`) or a
    ``redis://``/``rediss://``/``unix://`` URL (the store owns that client). ``ttl_s``: how long a
    PROCESSED record — and so duplicate detection — lasts. ``prefix``: key namespace.
    ``clock``: epoch-ms clock used by :meth:`purge` only; leases use the guard's clock.
    """

    def __init__(
        self,
        client_or_url: redis.Redis | str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        prefix: str = "idemq",
        clock: Clock | None = None,
        socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
    ) -> None:
        self._client: redis.Redis = self._connect(
            client_or_url, redis.Redis, ttl_s, prefix, clock, socket_timeout_s
        )
        self._command: Any = self._client.execute_command  # untyped in redis-py

    @property
    def client(self) -> redis.Redis:
        """The underlying redis-py client (for tests and ops)."""
        return self._client

    def _run(self, call: RunScript) -> Any:
        """One script call: EVALSHA, and on NOSCRIPT load the script and send it again."""
        argv = evalsha_argv(call)
        try:
            try:
                return self._command(*argv)
            except rx.NoScriptError:
                self._client.script_load(call.script.source)
                return self._command(*argv)
        except rx.RedisError as exc:
            raise translate_error(exc, call.script.name, self._server) from exc

    def _execute(self, step: Step) -> Any:
        if isinstance(step, RunScript):
            return self._run(step)
        if isinstance(step, Call):
            return self._call(step.args, _action(step))
        try:
            if isinstance(step, Batch):
                pipe: Any = self._client.pipeline(transaction=False)  # redis-py leaves it untyped
                for call in step.calls:
                    pipe.execute_command(*call)
                return pipe.execute()
        except rx.RedisError as exc:
            raise translate_error(exc, _action(step), self._server) from exc
        raise TypeError(f"RedisStore cannot execute {step!r}")

    def _call(self, argv: tuple[Any, ...], action: str) -> Any:
        """One plain command, its failure translated."""
        try:
            return self._command(*argv)
        except rx.RedisError as exc:
            raise translate_error(exc, action, self._server) from exc

    def claim(self, request: ClaimRequest) -> Claim:
        """Claim one message; see the module docstring for the outcomes."""
        stored = self._call(ops.claim_set(self._layout, request), "claim")
        claim = ops.claim_set_result(request, stored)
        if claim is None:  # an expired lease (or our own replayed claim): the script judges
            claim = ops.claim_result(request.key, self._run(ops.claim_call(self._layout, request)))
        return claim

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim a batch in one Lua call; the answers come back in order."""
        if not requests:
            return []
        replies = self._run(ops.claim_many_call(self._layout, requests))
        return ops.claim_many_result(requests, replies)

    def complete(self, key: Key, owner: str, result: str, now_ms: int) -> None:
        """PROCESSING → PROCESSED; raises :class:`~idemq.LeaseLostError` if ``owner`` lost it."""
        reply = self._run(ops.complete_call(self._layout, key, owner, result, now_ms))
        ops.complete_result(key, reply)

    def release(self, key: Key, owner: str) -> None:
        """Delete ``owner``'s PROCESSING record so the message can be retried; else no-op."""
        self._run(ops.release_call(self._layout, key, owner))

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
        return drive(ops.purge(self._layout, cutoff_ms, batch_size), self._execute)

    def stats(self, *, now_ms: int | None = None) -> StoreStats:
        """Counts, oldest records, stuck leases (at ``now_ms``, default the store's clock) and
        an estimated size; SCANs the prefix, so it is for ops, not hot paths."""
        now = self._clock() if now_ms is None else now_ms
        return drive(ops.stats(self._layout, now), self._execute)

    def force_release(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> bool:
        """Delete the PROCESSING record whoever owns it (never a PROCESSED one); True if done."""
        return drive(ops.force_release(self._layout, Key(consumer, message_id)), self._execute)

    def close(self) -> None:
        """Close the client if this store created it from a URL."""
        if self._owns_client:
            self._client.close()


class AsyncRedisStore(_RedisStoreBase):
    """Async twin of :class:`RedisStore` (``redis.asyncio.Redis`` or a URL); same primitives."""

    def __init__(
        self,
        client_or_url: redis.asyncio.Redis | str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        prefix: str = "idemq",
        clock: Clock | None = None,
        socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
    ) -> None:
        self._client: redis.asyncio.Redis = self._connect(
            client_or_url, redis.asyncio.Redis, ttl_s, prefix, clock, socket_timeout_s
        )
        self._command: Any = self._client.execute_command  # untyped in redis-py

    @property
    def client(self) -> redis.asyncio.Redis:
        """The underlying redis-py asyncio client (for tests and ops)."""
        return self._client

    async def _run(self, call: RunScript) -> Any:
        """See :meth:`RedisStore._run`."""
        argv = evalsha_argv(call)
        try:
            try:
                return await self._command(*argv)
            except rx.NoScriptError:
                await self._client.script_load(call.script.source)
                return await self._command(*argv)
        except rx.RedisError as exc:
            raise translate_error(exc, call.script.name, self._server) from exc

    async def _execute(self, step: Step) -> Any:
        if isinstance(step, RunScript):
            return await self._run(step)
        if isinstance(step, Call):
            return await self._call(step.args, _action(step))
        try:
            if isinstance(step, Batch):
                pipe: Any
                async with self._client.pipeline(transaction=False) as pipe:
                    for call in step.calls:
                        pipe.execute_command(*call)
                    return await pipe.execute()
        except rx.RedisError as exc:
            raise translate_error(exc, _action(step), self._server) from exc
        raise TypeError(f"AsyncRedisStore cannot execute {step!r}")

    async def _call(self, argv: tuple[Any, ...], action: str) -> Any:
        """See :meth:`RedisStore._call`."""
        try:
            return await self._command(*argv)
        except rx.RedisError as exc:
            raise translate_error(exc, action, self._server) from exc

    async def claim(self, request: ClaimRequest) -> Claim:
        """See :meth:`RedisStore.claim`."""
        stored = await self._call(ops.claim_set(self._layout, request), "claim")
        claim = ops.claim_set_result(request, stored)
        if claim is None:
            reply = await self._run(ops.claim_call(self._layout, request))
            claim = ops.claim_result(request.key, reply)
        return claim

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """See :meth:`RedisStore.claim_many`."""
        if not requests:
            return []
        replies = await self._run(ops.claim_many_call(self._layout, requests))
        return ops.claim_many_result(requests, replies)

    async def complete(self, key: Key, owner: str, result: str, now_ms: int) -> None:
        """See :meth:`RedisStore.complete`."""
        reply = await self._run(ops.complete_call(self._layout, key, owner, result, now_ms))
        ops.complete_result(key, reply)

    async def release(self, key: Key, owner: str) -> None:
        """See :meth:`RedisStore.release`."""
        await self._run(ops.release_call(self._layout, key, owner))

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
        return await adrive(ops.purge(self._layout, cutoff_ms, batch_size), self._execute)

    async def stats(self, *, now_ms: int | None = None) -> StoreStats:
        """See :meth:`RedisStore.stats`."""
        now = self._clock() if now_ms is None else now_ms
        return await adrive(ops.stats(self._layout, now), self._execute)

    async def force_release(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> bool:
        """See :meth:`RedisStore.force_release`."""
        key = Key(consumer, message_id)
        return await adrive(ops.force_release(self._layout, key), self._execute)

    async def close(self) -> None:
        """Close the client if this store created it from a URL."""
        if self._owns_client:
            await self._client.aclose()


def _cutoff_ms(now: Clock | int, older_than: timedelta) -> int:
    now_ms = now if isinstance(now, int) else now()
    return now_ms - older_than // timedelta(milliseconds=1)


def _action(step: Step) -> str:
    if isinstance(step, Call):
        return str(step.args[0])
    if isinstance(step, Batch):
        return f"pipeline of {len(step.calls)}"
    return type(step).__name__
