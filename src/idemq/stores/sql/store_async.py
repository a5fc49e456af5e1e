"""``AsyncSqlStore``: :class:`~idemq.stores.sql.SqlStore` on an asyncio engine.

The same plans (:mod:`idemq.stores.sql.dialects`), the same base, the same boundary
(:mod:`idemq.drivers.sql`); only the connection is async (psycopg 3 async, asyncmy, aiosqlite).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from idemq._clock import system_clock_ms
from idemq.drivers.sql import (
    abegin,
    arun,
    async_engine_from_url,
    driver_reports_aborts,
    translated,
)
from idemq.errors import ConfigurationError, StoreConflictError, StoreError
from idemq.stores.base import (
    DEFAULT_CONSUMER,
    Claim,
    ClaimRequest,
    ForgetResult,
    Key,
    Record,
    StoreStats,
)
from idemq.stores.sql.schema import DEFAULT_TABLE
from idemq.stores.sql.store import (
    DEFAULT_URL,
    OWN_TRANSACTION_ATTEMPTS,
    Primitive,
    SqlStoreBase,
)

__all__ = ["AsyncSqlStore"]

T = TypeVar("T")


class AsyncSqlStore(SqlStoreBase):
    """:class:`SqlStore` for asyncio (psycopg 3 async, asyncmy, aiosqlite)."""

    def __init__(
        self,
        url: str | URL | AsyncEngine = DEFAULT_URL,
        *,
        table: str = DEFAULT_TABLE,
        schema: str | None = None,
        mysql_flavor: str | None = None,
        lease_clock: str | None = None,
        expires_after_s: float | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if isinstance(url, AsyncEngine):
            self.engine = url
        else:
            self.engine = async_engine_from_url(url, **engine_kwargs)
        super().__init__(
            self.engine.url,
            table,
            schema=schema,
            mysql_flavor=mysql_flavor,
            lease_clock=lease_clock,
            expires_after_s=expires_after_s,
        )

    async def create_schema(self) -> None:
        """See :meth:`SqlStore.create_schema`."""
        with translated(f"create_schema on {self.where}"):
            async with self.engine.begin() as conn:
                await conn.run_sync(self._create_recorded)

    async def drop_schema(self) -> None:
        """See :meth:`SqlStore.drop_schema`."""
        with translated(f"drop_schema on {self.where}"):
            async with self.engine.begin() as conn:
                await conn.run_sync(self._drop_recorded)

    def transaction(self, connection: Any = None) -> AbstractAsyncContextManager[AsyncConnection]:
        """See :meth:`SqlStore.transaction` (``connection``: an ``AsyncConnection``)."""
        if connection is not None:
            return self._join(connection)
        return abegin(self.engine, self.where)

    @asynccontextmanager
    async def _join(self, connection: Any) -> AsyncIterator[AsyncConnection]:
        if not isinstance(connection, AsyncConnection):
            raise ConfigurationError(
                f"connection must be an SQLAlchemy AsyncConnection, got {type(connection)}"
            )
        ctx = connection.begin_nested() if connection.in_transaction() else connection.begin()
        async with ctx:
            yield connection

    async def begin_savepoint(self, tx: AsyncConnection) -> Any:
        """See :meth:`SqlStore.begin_savepoint`."""
        with translated(f"savepoint on {self.where}"):
            return await tx.begin_nested()

    async def end_savepoint(self, savepoint: Any, *, commit: bool) -> None:
        """See :meth:`SqlStore.end_savepoint`."""
        doing = "release savepoint" if commit else "rollback to savepoint"
        with translated(f"{doing} on {self.where}"):
            if commit:
                await savepoint.commit()
            else:
                await savepoint.rollback()

    async def translate_handler_error(
        self, tx: AsyncConnection, error: BaseException
    ) -> StoreError | None:
        """See :meth:`SqlStoreBase.transaction_lost_by`."""
        return self.transaction_lost_by(error)

    async def _in_transaction(self, tx: AsyncConnection, doing: str, primitive: Primitive[T]) -> T:
        """See :meth:`SqlStore._in_transaction`."""
        return await arun(tx, primitive(self._plans_for(tx.dialect)), f"{doing} on {self.where}")

    async def _own_transaction(self, doing: str, primitive: Primitive[T]) -> T:
        """See :meth:`SqlStore._own_transaction`."""
        attempt = 1
        while True:
            try:
                async with abegin(self.engine, self.where) as conn:
                    return await self._in_transaction(conn, doing, primitive)
            except StoreConflictError:
                if attempt >= OWN_TRANSACTION_ATTEMPTS:
                    raise
                await asyncio.sleep(self.conflict_pause_s(attempt))
                attempt += 1

    async def claim_in(self, tx: AsyncConnection, request: ClaimRequest) -> Claim:
        """Claim inside ``tx``, the business transaction (the row is written PROCESSED)."""
        return await self._in_transaction(
            tx, "claim", lambda plans: plans.claim_unexpired(request, True)
        )

    async def claim_many_in(
        self, tx: AsyncConnection, requests: Sequence[ClaimRequest]
    ) -> list[Claim]:
        """Claim a batch inside ``tx``: one multi-row insert, one read."""
        return await self._in_transaction(
            tx, "claim_many", lambda plans: plans.claim_many(requests, True)
        )

    async def confirm_in(
        self, tx: AsyncConnection, key: Key, owner: str, result: str, *, deferred: bool = False
    ) -> None:
        """See :meth:`SqlStore.confirm_in`."""
        driver = await self._driver_connection(tx)
        primitive = self._confirm_plan(driver, key, owner, result, deferred=deferred)
        if primitive is not None:
            await self._in_transaction(tx, "confirm", primitive)

    async def confirm_many_in(self, tx: AsyncConnection, requests: Sequence[ClaimRequest]) -> None:
        """See :meth:`SqlStore.confirm_many_in`."""
        if requests and self._must_read_rows(await self._driver_connection(tx), requests):
            keys = [r.key for r in requests]
            owners = [r.owner for r in requests]
            await self._in_transaction(
                tx, "confirm", lambda plans: plans.confirm_many(keys, owners)
            )

    async def _driver_connection(self, tx: AsyncConnection) -> Any:
        """See :meth:`SqlStore._driver_connection`."""
        if not driver_reports_aborts(tx.dialect):
            return None
        with translated(f"confirm on {self.where}"):
            return (await tx.get_raw_connection()).driver_connection

    async def release_in(self, tx: AsyncConnection, key: Key, owner: str) -> None:
        """Undo a batch claim of ``owner`` inside ``tx``."""
        await self._in_transaction(tx, "release", lambda plans: plans.release_in(key, owner))

    async def claim(self, request: ClaimRequest) -> Claim:
        """Claim in lease mode, in a short transaction of the store's own."""
        return await self._own_transaction(
            "claim", lambda plans: plans.claim_unexpired(request, False)
        )

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim a batch in lease mode (one transaction)."""
        return await self._own_transaction(
            "claim_many", lambda plans: plans.claim_many(requests, False)
        )

    async def complete(self, key: Key, owner: str, result: str, now_ms: int) -> None:
        """See :meth:`SqlStore.complete`."""
        await self._own_transaction(
            "complete", lambda plans: plans.complete(key, owner, result, now_ms)
        )

    async def release(self, key: Key, owner: str) -> None:
        """Delete the PROCESSING record if ``owner`` still holds it."""
        await self._own_transaction("release", lambda plans: plans.release(key, owner))

    async def get(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> Record | None:
        """The record of ``message_id`` for ``consumer``, or None."""
        key = Key(consumer, message_id)
        return await self._own_transaction("get", lambda plans: plans.get(key))

    async def find(self, message_id: str) -> list[Record]:
        """Every consumer's record of ``message_id``."""
        return await self._own_transaction("find", lambda plans: plans.find(message_id))

    async def in_progress(self, *, limit: int = 100) -> list[Record]:
        """PROCESSING records, oldest first."""
        return await self._own_transaction("in_progress", lambda plans: plans.in_progress(limit))

    async def purge(
        self, older_than: timedelta, *, batch_size: int = 1000, now_ms: int | None = None
    ) -> int:
        """See :meth:`SqlStore.purge`."""
        cutoff_ms = self._cutoff_ms(older_than, now_ms)
        total = 0
        while True:
            deleted = await self._own_transaction(
                "purge", lambda plans: plans.purge_batch(cutoff_ms, batch_size)
            )
            total += deleted
            if deleted < batch_size:
                return total

    async def stats(self, *, now_ms: int | None = None) -> StoreStats:
        """See :meth:`SqlStore.stats`."""
        now = system_clock_ms() if now_ms is None else now_ms
        return await self._own_transaction("stats", lambda plans: plans.stats(now))

    async def renew(self, key: Key, owner: str, lease_until_ms: int, now_ms: int) -> bool:
        """See :meth:`idemq.stores.base.GuardStore.renew`."""
        return await self._own_transaction(
            "renew", lambda plans: plans.renew(key, owner, lease_until_ms, now_ms)
        )

    async def forget(
        self,
        message_id: str,
        consumer: str = DEFAULT_CONSUMER,
        *,
        force: bool = False,
        now_ms: int | None = None,
    ) -> ForgetResult:
        """See :meth:`idemq.stores.base.GuardStore.forget`."""
        key = Key(consumer, message_id)
        now = system_clock_ms() if now_ms is None else now_ms
        return await self._own_transaction(
            "forget", lambda plans: plans.forget(key, force=force, now_ms=now)
        )

    async def force_release(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> bool:
        """See :meth:`SqlStore.force_release`."""
        key = Key(consumer, message_id)
        return await self._own_transaction("force_release", lambda plans: plans.force_release(key))

    async def close(self) -> None:
        """See :meth:`SqlStore.close`."""
        await self.engine.dispose()
