"""``AsyncSqlStore``: the asyncio twin of :class:`~idemq.stores.sql.SqlStore`.

Same plans (:mod:`idemq.stores.sql.plans`), same base, same plumbing (:mod:`idemq.drivers.sql`);
only the connection is async (psycopg 3 async, asyncmy, aiosqlite).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from idemq._clock import system_clock_ms
from idemq.drivers.sql import (
    IdleConnections,
    arun,
    async_url,
    keep_limit,
    parse_url,
    prepare_sqlite,
    reusable,
    translate_errors,
)
from idemq.errors import (
    ConfigurationError,
    LeaseLostError,
)
from idemq.stores.base import DEFAULT_CONSUMER, Claim, ClaimRequest, Key, Record, StoreStats
from idemq.stores.sql.schema import DEFAULT_TABLE
from idemq.stores.sql.store import DEFAULT_URL, SqlStoreBase

__all__ = ["AsyncSqlStore"]


class AsyncSqlStore(SqlStoreBase):
    """The asyncio twin of :class:`SqlStore` (psycopg 3 async, asyncmy, aiosqlite)."""

    def __init__(
        self,
        url: str | URL | AsyncEngine = DEFAULT_URL,
        *,
        table: str = DEFAULT_TABLE,
        schema: str | None = None,
        mysql_flavor: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if isinstance(url, AsyncEngine):
            self.engine = url
        else:
            parsed = async_url(parse_url(url))
            try:
                self.engine = create_async_engine(parsed, **engine_kwargs)
            except (ArgumentError, NoSuchModuleError, ImportError) as exc:
                raise ConfigurationError(f"cannot use {parsed.drivername!r}: {exc}") from exc
            if self.engine.dialect.name == "sqlite":
                prepare_sqlite(self.engine.sync_engine)
        super().__init__(self.engine.url, table, schema, self.engine.dialect, mysql_flavor)
        self._idle: IdleConnections[AsyncConnection] = IdleConnections(
            keep_limit(self.engine.sync_engine.pool)
        )

    async def create_schema(self) -> None:
        with translate_errors("create_schema", self.where):
            async with self.engine.begin() as conn:
                await conn.run_sync(
                    lambda sync: self._ddl_table(sync.dialect).create(sync, checkfirst=True)
                )

    async def drop_schema(self) -> None:
        with translate_errors("drop_schema", self.where):
            async with self.engine.begin() as conn:
                await conn.run_sync(lambda sync: self.table.drop(sync, checkfirst=True))

    async def _exec(self, conn: AsyncConnection, plan: str, *args: Any, what: str) -> Any:
        with translate_errors(what, self.where):
            return await arun(conn, getattr(self._ops_for(conn.dialect), plan)(*args))

    async def _short(self, plan: str, *args: Any, what: str) -> Any:
        with translate_errors(what, self.where):
            async with self.transaction() as conn:
                return await arun(conn, getattr(self._ops_for(conn.dialect), plan)(*args))

    @asynccontextmanager
    async def transaction(self, connection: Any = None) -> AsyncIterator[AsyncConnection]:
        """See :meth:`SqlStore.transaction` (``connection``: an ``AsyncConnection``)."""
        if connection is not None:
            if not isinstance(connection, AsyncConnection):
                raise ConfigurationError(
                    f"connection must be an SQLAlchemy AsyncConnection, got {type(connection)}"
                )
            ctx = connection.begin_nested() if connection.in_transaction() else connection.begin()
            async with ctx:
                yield connection
            return
        conn = await self._checkout()
        with translate_errors("begin", self.where):
            try:
                trans = await conn.begin()
            except BaseException:
                await self._checkin(conn, clean=False)
                raise
        clean = False
        try:
            yield conn
        except BaseException:
            with translate_errors("rollback", self.where):
                await trans.rollback()
            clean = True
            raise
        else:
            with translate_errors("commit", self.where):
                await trans.commit()
            clean = True
        finally:
            await self._checkin(conn, clean=clean)

    async def _checkout(self) -> AsyncConnection:
        conn = self._idle.take()
        if conn is None:
            with translate_errors("connect", self.where):
                conn = await self.engine.connect()
        return conn

    async def _checkin(self, conn: AsyncConnection, *, clean: bool) -> None:
        """See :meth:`SqlStore._checkin`."""
        sync_engine = self.engine.sync_engine
        if clean and reusable(conn.sync_connection, sync_engine) and self._idle.keep(conn):
            return
        invalidated = conn.invalidated
        await conn.close()
        if invalidated:
            for idle in self._idle.drain():
                await idle.close()

    async def begin_savepoint(self, tx: AsyncConnection) -> Any:
        """See :meth:`SqlStore.begin_savepoint`."""
        with translate_errors("savepoint", self.where):
            return await tx.begin_nested()

    async def end_savepoint(self, savepoint: Any, *, commit: bool) -> None:
        """See :meth:`SqlStore.end_savepoint`."""
        with translate_errors(
            "release savepoint" if commit else "rollback to savepoint", self.where
        ):
            if commit:
                await savepoint.commit()
            else:
                await savepoint.rollback()

    async def claim_in(self, tx: AsyncConnection, request: ClaimRequest) -> Claim:
        return await self._exec(tx, "claim", request, True, what="claim")  # type: ignore[no-any-return]

    async def claim_many_in(
        self, tx: AsyncConnection, requests: Sequence[ClaimRequest]
    ) -> list[Claim]:
        return await self._exec(tx, "claim_many", requests, True, what="claim_many")  # type: ignore[no-any-return]

    async def save_result_in(self, tx: AsyncConnection, key: Key, result: str) -> None:
        await self._exec(tx, "save_result", key, result, what="save_result")

    async def release_in(self, tx: AsyncConnection, key: Key, owner: str) -> None:
        await self._exec(tx, "release_in", key, owner, what="release")

    async def claim(self, request: ClaimRequest) -> Claim:
        return await self._short("claim", request, False, what="claim")  # type: ignore[no-any-return]

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        return await self._short("claim_many", requests, False, what="claim_many")  # type: ignore[no-any-return]

    async def complete(self, key: Key, owner: str, result: str, now_ms: int) -> None:
        if not await self._short("complete", key, owner, result, now_ms, what="complete"):
            raise LeaseLostError(
                f"lease on {key.message_id!r} ({key.consumer}) was lost before complete"
            )

    async def release(self, key: Key, owner: str) -> None:
        await self._short("release", key, owner, what="release")

    async def get(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> Record | None:
        return await self._short("get", Key(consumer, message_id), what="get")  # type: ignore[no-any-return]

    async def find(self, message_id: str) -> list[Record]:
        return await self._short("find", message_id, what="find")  # type: ignore[no-any-return]

    async def in_progress(self, *, limit: int = 100) -> list[Record]:
        return await self._short("in_progress", limit, what="in_progress")  # type: ignore[no-any-return]

    async def purge(
        self, older_than: timedelta, *, batch_size: int = 1000, now_ms: int | None = None
    ) -> int:
        cutoff = (now_ms if now_ms is not None else system_clock_ms()) - int(
            older_than.total_seconds() * 1000
        )
        total = 0
        while True:
            deleted: int = await self._short("purge_batch", cutoff, batch_size, what="purge")
            total += deleted
            if deleted < batch_size:
                return total

    async def stats(self, *, now_ms: int | None = None) -> StoreStats:
        """See :meth:`SqlStore.stats`."""
        now = system_clock_ms() if now_ms is None else now_ms
        return await self._short("stats", now, what="stats")  # type: ignore[no-any-return]

    async def force_release(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> bool:
        """See :meth:`SqlStore.force_release`."""
        key = Key(consumer, message_id)
        return await self._short("force_release", key, what="force_release")  # type: ignore[no-any-return]

    async def close(self) -> None:
        for conn in self._idle.drain():
            await conn.close()
        await self.engine.dispose()
