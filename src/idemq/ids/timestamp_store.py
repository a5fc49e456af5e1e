"""Where a :class:`~idemq.MessageIdGenerator` persists how far ahead it may have issued ids.

A generator that restarts after the wall clock went back would reissue the ids it handed out in
the "future" (Meituan Leaf's known failure). With a store, the generator writes a *reservation*
``until_ms`` before issuing any id at or after it, and every id it issues has a timestamp
``< until_ms``. On start it reads the reservation and never issues below it.

The protocol is two calls, both monotonic on the backend: :meth:`LastTimestampStore.load` and
:meth:`LastTimestampStore.advance` (which only ever raises the stored value, atomically where two
writers could race). Key one store per ``(prefix, node)`` — a leased node id moving between
machines then carries its reservation with it (use Redis or SQL for that; a file is per host).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Protocol, runtime_checkable

import redis
import sqlalchemy as sa

from idemq._plan import drive
from idemq.drivers.redis import (
    AnyRedis,
    Call,
    LuaScript,
    Op,
    RedisExecutor,
    RunScript,
    redis_client,
)
from idemq.drivers.sql import create_table_once, sql_engine, translated
from idemq.errors import ConfigurationError, DuplicateKeyError, StoreUnavailableError

__all__ = [
    "FileTimestampStore",
    "LastTimestampStore",
    "RedisTimestampStore",
    "SqlTimestampStore",
    "sql_engine",
]


@runtime_checkable
class LastTimestampStore(Protocol):
    """Persists the upper bound (epoch ms, exclusive) of the timestamps a generator issued."""

    def load(self) -> int | None:
        """The stored reservation, or ``None`` if nothing was stored yet."""

    def advance(self, until_ms: int) -> None:
        """Durably raise the stored value to ``until_ms`` (never lower it) before returning."""


class FileTimestampStore:
    """A local file holding the reservation as decimal text; replaced atomically and fsynced,
    so a crash mid-write leaves either the old or the new value, never a torn one."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> int | None:
        """See :meth:`LastTimestampStore.load`."""
        try:
            text = self.path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailableError(f"cannot read {self.path}") from exc
        try:
            return int(text)
        except ValueError as exc:
            raise ConfigurationError(f"{self.path} does not hold an integer: {text!r}") from exc

    def advance(self, until_ms: int) -> None:
        """See :meth:`LastTimestampStore.advance`."""
        current = self.load()
        if current is not None and current >= until_ms:
            return
        try:
            fd, tmp = tempfile.mkstemp(prefix=self.path.name, dir=self.path.parent)
            try:
                os.write(fd, str(until_ms).encode("ascii"))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            # fsync the directory too: without it the rename itself may not survive a power cut.
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise StoreUnavailableError(
                f"cannot persist the id reservation to {self.path}"
            ) from exc


_ADVANCE = LuaScript(
    "advance_id_reservation",
    """
-- KEYS[1] reservation key   ARGV[1] until_ms
-- Sets the key to max(stored, ARGV[1]) atomically, so two generators racing on one key can
-- never lower it. Returns the stored value afterwards.
local current = tonumber(redis.call('GET', KEYS[1]) or '-1')
local wanted = tonumber(ARGV[1])
if wanted > current then
  redis.call('SET', KEYS[1], ARGV[1])
  return wanted
end
return current
""",
)


class RedisTimestampStore:
    """A Redis string (no TTL) holding the reservation; durability is Redis's (use AOF)."""

    def __init__(self, client_or_url: AnyRedis | str, key: str) -> None:
        self.key = key
        self._owns_client = isinstance(client_or_url, str)
        self._client = redis_client(client_or_url, redis.Redis)
        self._execute = RedisExecutor(self._client)

    def close(self) -> None:
        """Close the client if this store created it from a URL."""
        if self._owns_client:
            self._client.close()

    def load(self) -> int | None:
        """See :meth:`LastTimestampStore.load`."""
        return drive(_load(self.key), self._execute)

    def advance(self, until_ms: int) -> None:
        """See :meth:`LastTimestampStore.advance`."""
        drive(_advance(self.key, until_ms), self._execute)


def _load(key: str) -> Op[int | None]:
    raw = yield Call("get", key)
    return None if raw is None else int(raw)


def _advance(key: str, until_ms: int) -> Op[None]:
    yield RunScript(_ADVANCE, (key,), (until_ms,))


class SqlTimestampStore:
    """One row ``(key, until_ms)`` in ``table`` (created on first use if missing)."""

    def __init__(
        self, engine_or_url: sa.Engine | str, key: str, *, table: str = "idemq_id_timestamp"
    ):
        self.key = key
        self._owns_engine = isinstance(engine_or_url, str)
        self.engine = sql_engine(engine_or_url)
        self.table = sa.Table(
            table,
            sa.MetaData(),
            sa.Column("key", sa.String(128), primary_key=True),
            sa.Column("until_ms", sa.BigInteger, nullable=False),
        )
        create_table_once(self.engine, self.table)

    def close(self) -> None:
        """Dispose of the engine if this store created it from a URL."""
        if self._owns_engine:
            self.engine.dispose()

    def load(self) -> int | None:
        """See :meth:`LastTimestampStore.load`."""
        query = sa.select(self.table.c.until_ms).where(self.table.c.key == self.key)
        with translated(f"read id reservation {self.key!r}"), self.engine.connect() as conn:
            value = conn.execute(query).scalar_one_or_none()
        return None if value is None else int(value)

    def advance(self, until_ms: int) -> None:
        """See :meth:`LastTimestampStore.advance`."""
        t = self.table
        # Conditional UPDATE: only ever raises the value, even with concurrent writers.
        raise_value = (
            sa.update(t)
            .where(t.c.key == self.key, t.c.until_ms < until_ms)
            .values(until_ms=until_ms)
        )
        doing = f"persist id reservation {self.key!r}"
        with translated(doing), self.engine.begin() as conn:
            if conn.execute(raise_value).rowcount == 1:
                return
            exists = conn.execute(sa.select(t.c.key).where(t.c.key == self.key)).first()
            if exists is not None:
                return  # already at or above until_ms
        try:
            with translated(doing), self.engine.begin() as conn:
                conn.execute(sa.insert(t).values(key=self.key, until_ms=until_ms))
        except DuplicateKeyError:
            # Someone inserted first: fall back to the conditional update.
            with translated(doing), self.engine.begin() as conn:
                conn.execute(raise_value)
