"""The two node-lease backends: small primitives, each atomic on the server.

Expiry is judged by the **server's** clock (Redis ``PX``; the SQL server's current time), so the
processes competing for a pool never compare their own, possibly skewed, clocks.
"""

from __future__ import annotations

import sqlalchemy as sa

from idemq._plan import drive
from idemq.drivers.redis import EXTEND_IF_OWNER, AnyRedis, Call, Op, RedisExecutor, RunScript
from idemq.drivers.sql import create_table_once, translated
from idemq.errors import DuplicateKeyError

__all__ = ["RedisLeaseBackend", "SqlLeaseBackend"]

_MGET_CHUNK = 500


class RedisLeaseBackend:
    """Leases as keys ``idemq:node-lease:{pool}:{node}`` holding the owner token, with ``PX``."""

    def __init__(self, client: AnyRedis, *, owns_client: bool = False) -> None:
        self._client = client
        self._owns_client = owns_client
        self._execute = RedisExecutor(client)
        # The nodes of a pool are keys of many Cluster slots: there the MGET hint is redis-py's
        # mget_nonatomic (one MGET per slot); SET NX still decides, one key at a time.
        self._mget = "mget_nonatomic" if self._execute.cluster else "mget"

    def close(self) -> None:
        """Close the client if this backend created it (from a URL)."""
        if self._owns_client:
            self._client.close()

    @staticmethod
    def key(pool: str, node: str) -> str:
        """The Redis key of one node's lease."""
        return f"idemq:node-lease:{pool}:{node}"

    def try_acquire(self, pool: str, nodes: list[str], owner: str, ttl_ms: int) -> str | None:
        """See :class:`idemq.ids.node_lease.LeaseBackend`."""
        return drive(_take_free_node(pool, nodes, owner, ttl_ms, self._mget), self._execute)

    def renew(self, pool: str, node: str, owner: str, ttl_ms: int) -> bool:
        """See :class:`idemq.ids.node_lease.LeaseBackend`."""
        return drive(_extend_if_owner(self.key(pool, node), owner, ttl_ms), self._execute)

    def release(self, pool: str, node: str, owner: str, hold_ms: int) -> None:
        """See :class:`idemq.ids.node_lease.LeaseBackend`.

        Release does not delete: it lets our lease run out after a short hold, because a process
        that took the node at once could issue ids in the very millisecond (or, on a host whose
        clock is a little behind, the very second) of our last ones: identical ids.
        """
        drive(_extend_if_owner(self.key(pool, node), owner, hold_ms), self._execute)


def _take_free_node(
    pool: str, nodes: list[str], owner: str, ttl_ms: int, mget: str = "mget"
) -> Op[str | None]:
    """The first node of ``nodes`` whose lease ``owner`` could take, or ``None``."""
    for start in range(0, len(nodes), _MGET_CHUNK):
        chunk = nodes[start : start + _MGET_CHUNK]
        # One MGET to skip held nodes; SET NX is still what decides (the MGET may be stale).
        held = yield Call(mget, [RedisLeaseBackend.key(pool, n) for n in chunk])
        for node, holder in zip(chunk, held, strict=True):
            if holder is None:
                key = RedisLeaseBackend.key(pool, node)
                if (yield Call("set", key, owner, nx=True, px=ttl_ms)):
                    return node
    return None


def _extend_if_owner(key: str, owner: str, ttl_ms: int) -> Op[bool]:
    extended = yield RunScript(EXTEND_IF_OWNER, (key,), (owner, ttl_ms))
    return bool(extended)


def _server_now_ms(dialect: str) -> sa.ColumnElement[int]:
    if dialect == "postgresql":
        sql = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)"
    elif dialect in ("mysql", "mariadb"):
        sql = "CAST(FLOOR(UNIX_TIMESTAMP(NOW(3)) * 1000) AS SIGNED)"
    elif dialect == "sqlite":
        sql = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"
    else:  # pragma: no cover - other dialects: the portable (second precision) fallback
        return sa.cast(sa.func.extract("epoch", sa.func.current_timestamp()) * 1000, sa.BigInteger)
    return sa.literal_column(sql, sa.BigInteger)


class SqlLeaseBackend:
    """Leases as rows ``(pool, node, owner, lease_until_ms)`` of ``table``.

    Taking a node is an ``INSERT`` (primary key ``(pool, node)`` arbitrates) or, for an expired
    row, ``UPDATE … WHERE lease_until_ms < now`` — whoever's statement matches the row wins, the
    others see ``rowcount == 0`` and move on.
    """

    def __init__(
        self, engine: sa.Engine, table: str = "idemq_node_lease", *, owns_engine: bool = False
    ) -> None:
        self.engine = engine
        self._owns_engine = owns_engine
        self.table = sa.Table(
            table,
            sa.MetaData(),
            sa.Column("pool", sa.String(64), primary_key=True),
            sa.Column("node", sa.String(64), primary_key=True),
            sa.Column("owner", sa.String(96), nullable=False),
            sa.Column("lease_until_ms", sa.BigInteger, nullable=False),
        )
        self._now_ms = _server_now_ms(engine.dialect.name)
        create_table_once(engine, self.table)

    def close(self) -> None:
        """Dispose of the engine's connections if this backend created it (from a URL)."""
        if self._owns_engine:
            self.engine.dispose()

    def try_acquire(self, pool: str, nodes: list[str], owner: str, ttl_ms: int) -> str | None:
        """See :class:`idemq.ids.node_lease.LeaseBackend`."""
        t = self.table
        doing = f"lease a node of pool {pool!r} in {t.name}"
        with translated(doing), self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.c.node, t.c.lease_until_ms >= self._now_ms).where(t.c.pool == pool)
            ).all()
        live = {node for node, is_live in rows if is_live}
        expired = {node for node, is_live in rows if not is_live}
        for node in nodes:
            if node in live:
                continue
            if node in expired:
                take = (
                    sa.update(t)
                    .where(t.c.pool == pool, t.c.node == node, t.c.lease_until_ms < self._now_ms)
                    .values(owner=owner, lease_until_ms=self._now_ms + ttl_ms)
                )
                with translated(doing), self.engine.begin() as conn:
                    if conn.execute(take).rowcount == 1:
                        return node
                continue
            insert = sa.insert(t).values(
                pool=pool, node=node, owner=owner, lease_until_ms=self._now_ms + ttl_ms
            )
            try:
                with translated(doing), self.engine.begin() as conn:
                    conn.execute(insert)
            except DuplicateKeyError:
                continue  # another process inserted it first
            return node
        return None

    def renew(self, pool: str, node: str, owner: str, ttl_ms: int) -> bool:
        """See :class:`idemq.ids.node_lease.LeaseBackend`."""
        t = self.table
        stmt = (
            sa.update(t)
            .where(t.c.pool == pool, t.c.node == node, t.c.owner == owner)
            .values(lease_until_ms=self._now_ms + ttl_ms)
        )
        with translated(f"renew node {node!r} of pool {pool!r}"), self.engine.begin() as conn:
            return conn.execute(stmt).rowcount == 1

    def release(self, pool: str, node: str, owner: str, hold_ms: int) -> None:
        """See :class:`idemq.ids.node_lease.LeaseBackend`."""
        t = self.table
        # Expire after a short hold rather than DELETE; see RedisLeaseBackend.release for why.
        stmt = (
            sa.update(t)
            .where(t.c.pool == pool, t.c.node == node, t.c.owner == owner)
            .values(lease_until_ms=self._now_ms + hold_ms)
        )
        with translated(f"release node {node!r} of pool {pool!r}"), self.engine.begin() as conn:
            conn.execute(stmt)
