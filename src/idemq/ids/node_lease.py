"""Node ids leased from Redis or SQL, so two live processes never share one.

Two generators with the same node id issue the same ids in the same millisecond: duplicates that
dedup then *drops* as "already processed". Fixed node ids per host break as soon as one host runs
two processes, and Leaf-style allocation that never recycles ids runs out. A lease fixes both:

* :func:`lease_node` takes the first free node of a pool, atomically on the server (Redis
  ``SET NX PX`` with an owner token; SQL ``INSERT`` or a conditional ``UPDATE`` of an expired
  row), expiring after ``ttl_s`` on the **server's** clock;
* a daemon thread renews it every ``ttl_s / 3`` (Lua / ``UPDATE … WHERE owner = ?``: only the
  owner can renew or release);
* a dead process simply stops renewing, its lease expires, and its node id is reused.

Timeline of the race this guards against (why the lease is "lost" *locally* at a deadline)::

    A: renew ok at t0 ── store unreachable ──────────── t0+ttl: A's lease expires on the server
    B:                                                   takes the node, issues ids
    A: must have stopped issuing before t0+ttl, even without hearing from the store

So every renew records its local monotonic send time; :meth:`NodeLease.ensure_valid` (called by
the generator when the millisecond changes) raises :class:`~idemq.LeaseLostError` once
``send + ttl - margin`` has passed, whether or not the store answered. The lease ``ttl_s`` also
bounds the clock skew tolerated between hosts reusing one node id (a new holder starts at least
``ttl_s`` after the old one stopped); combine with a shared
:class:`~idemq.ids.timestamp_store.RedisTimestampStore` keyed by node to remove even that.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import redis
import sqlalchemy as sa

from idemq.drivers.redis import redis_client
from idemq.drivers.sql import sql_engine
from idemq.drivers.urls import is_redis_url
from idemq.errors import ConfigurationError, LeaseLostError, StoreError
from idemq.ids.format import validate_id_part
from idemq.ids.node_lease_backends import RedisLeaseBackend, SqlLeaseBackend

__all__ = ["LeaseBackend", "NodeLease", "lease_node"]

logger = logging.getLogger(__name__)


class LeaseBackend(Protocol):
    """Three primitives, each atomic on the server; times are the server's."""

    def try_acquire(self, pool: str, nodes: list[str], owner: str, ttl_ms: int) -> str | None:
        """Take the first free (absent or expired) node of ``nodes``; ``None`` if all are held."""

    def renew(self, pool: str, node: str, owner: str, ttl_ms: int) -> bool:
        """Extend the lease if ``owner`` still holds it; ``False`` if it does not."""

    def release(self, pool: str, node: str, owner: str, hold_ms: int) -> None:
        """Let the lease expire ``hold_ms`` from now if ``owner`` still holds it."""

    def close(self) -> None:
        """Free connections the backend opened itself."""


class NodeLease:
    """A leased node id; use as a context manager (releases on exit) or call :meth:`close`.

    ``lost`` turns true (and ``on_lost`` runs once, from the thread that noticed) when renewal is
    refused or when the local deadline passes without a successful renewal. A lost lease stays
    lost: the node may already be someone else's.
    """

    def __init__(
        self,
        backend: LeaseBackend,
        *,
        pool: str,
        node: str,
        owner: str,
        ttl_s: float,
        acquired_at_s: float,
        on_lost: Callable[[NodeLease], None] | None = None,
        release_hold_s: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
        renew_in_background: bool = True,
    ) -> None:
        self.pool = pool
        self.node = node
        self.owner = owner
        self.ttl_s = ttl_s
        self._backend = backend
        self._on_lost = on_lost
        self._release_hold_s = release_hold_s
        self._monotonic = monotonic
        # Stop issuing a little before the server-side expiry: covers clock-rate drift between
        # this host and the store and the time an id takes to reach the broker.
        self._margin_s = min(1.0, ttl_s / 10)
        self._deadline_s = acquired_at_s + ttl_s
        self._lost_reason: str | None = None
        self._closed = False
        self._state_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if renew_in_background:
            self._thread = threading.Thread(
                target=self._renew_loop, name=f"idemq-node-lease-{pool}-{node}", daemon=True
            )
            self._thread.start()

    def __repr__(self) -> str:
        return f"NodeLease(pool={self.pool!r}, node={self.node!r}, lost={self.lost})"

    @property
    def lost(self) -> bool:
        """True once the lease is, or may be, held by someone else (final)."""
        return self._lost_reason is not None or self._monotonic() >= self._deadline_s

    def ensure_valid(self) -> None:
        """Raise :class:`~idemq.LeaseLostError` unless this process still safely holds the node."""
        if self._lost_reason is None and self._monotonic() >= self._deadline_s - self._margin_s:
            self._mark_lost(f"not renewed within ttl_s={self.ttl_s}")
        if self._lost_reason is not None:
            raise LeaseLostError(f"node {self.node!r} of pool {self.pool!r}: {self._lost_reason}")

    def renew(self) -> None:
        """Renew now (the background thread does this every ``ttl_s / 3``).

        Raises :class:`~idemq.LeaseLostError` if the lease is lost and
        :class:`~idemq.StoreError` if the store did not answer or failed
        (:class:`~idemq.StoreUnavailableError` when it could not be reached; the lease stays
        valid until its deadline either way, and the caller may retry).
        """
        self.ensure_valid()
        # The server's expiry is at least send time + ttl: measure before the request leaves.
        sent_s = self._monotonic()
        ttl_ms = int(self.ttl_s * 1000)
        if not self._backend.renew(self.pool, self.node, self.owner, ttl_ms):
            self._mark_lost("renewal refused: the lease expired and was taken over")
            self.ensure_valid()
        with self._state_lock:
            if self._lost_reason is None:
                self._deadline_s = sent_s + self.ttl_s

    def close(self) -> None:
        """Stop renewing and release the node (if still ours): another process can take it
        ``release_hold_s`` later (not at once: it could reissue our last millisecond's ids)."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            was_lost = self._lost_reason is not None
            self._lost_reason = self._lost_reason or "lease closed"
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if not was_lost:
            try:
                hold_ms = int(self._release_hold_s * 1000)
                self._backend.release(self.pool, self.node, self.owner, hold_ms)
            except StoreError:
                # Not fatal: the lease expires by itself after ttl_s.
                logger.warning("could not release node %s of pool %s", self.node, self.pool)
        self._backend.close()

    def __enter__(self) -> NodeLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _mark_lost(self, reason: str) -> None:
        with self._state_lock:
            if self._lost_reason is not None:
                return
            self._lost_reason = reason
        self._stop.set()
        logger.error("node lease lost: pool=%s node=%s (%s)", self.pool, self.node, reason)
        if self._on_lost is not None:
            try:
                self._on_lost(self)
            except Exception:
                logger.exception("on_lost callback failed for node %s", self.node)

    def _renew_loop(self) -> None:
        interval_s = self.ttl_s / 3
        while not self._stop.wait(interval_s):
            try:
                self.renew()
                interval_s = self.ttl_s / 3
            except LeaseLostError:
                return
            except StoreError:
                # Retry sooner; ensure_valid() declares the lease lost at its deadline anyway.
                logger.warning("renewing node %s of pool %s failed; retrying", self.node, self.pool)
                interval_s = self.ttl_s / 10


def _owner_token() -> str:
    # Host and pid make a stuck lease traceable to its process; the random part keeps two leases
    # of one process (or a recycled pid) apart.
    return f"{socket.gethostname()[:30]}:{os.getpid()}:{uuid.uuid4().hex[:16]}"


def _node_names(nodes: Iterable[int | str], node_format: str) -> list[str]:
    names = [node_format.format(n) if isinstance(n, int) else n for n in nodes]
    for name in names:
        validate_id_part("node", name)
    if not names or len(set(names)) != len(names):
        raise ConfigurationError("nodes must be a non-empty collection of distinct node ids")
    return names


def lease_node(
    backend: Any,
    *,
    pool: str = "default",
    nodes: Iterable[int | str] = range(1, 1000),
    node_format: str = "N{:03d}",
    ttl_s: float = 30.0,
    on_lost: Callable[[NodeLease], None] | None = None,
    release_hold_s: float = 1.0,
    sql_table: str = "idemq_node_lease",
    renew_in_background: bool = True,
    monotonic: Callable[[], float] = time.monotonic,
) -> NodeLease:
    """Lease the first free node id of ``pool`` and keep it renewed in the background.

    ``backend`` is a redis-py client, a SQLAlchemy Engine, or a URL (``redis://…`` or any
    SQLAlchemy URL; SQL creates ``sql_table`` if missing). ``nodes`` are candidate ids: ints are
    formatted with ``node_format`` (``N001``…), strings used as is. Raises
    :class:`~idemq.ConfigurationError` when every node of the pool is held by a live process,
    :class:`~idemq.StoreUnavailableError` when the store cannot be reached,
    :class:`~idemq.StoreConflictError` when the database rolled this lease back for a
    deadlock with a process leasing the same node (call again). ``on_lost`` is
    called once if the lease is lost; ``close()`` frees the node ``release_hold_s`` later.
    ``monotonic`` (seconds) times the local validity deadline; inject it to test expiry.

    Example::

        with idemq.lease_node("redis://127.0.0.1:6379/0", pool="ORDER") as lease:
            ids = idemq.MessageIdGenerator("ORDER", lease)
    """
    validate_id_part("pool", pool)
    if not ttl_s > 0 or release_hold_s < 0:
        raise ConfigurationError(f"need ttl_s > 0 and release_hold_s >= 0, got {ttl_s!r}")
    names = _node_names(nodes, node_format)
    lease_backend: LeaseBackend
    if isinstance(backend, sa.Engine) or (isinstance(backend, str) and not is_redis_url(backend)):
        owns = isinstance(backend, str)
        lease_backend = SqlLeaseBackend(sql_engine(backend), sql_table, owns_engine=owns)
    elif isinstance(backend, str) or hasattr(backend, "register_script"):
        owns = isinstance(backend, str)
        lease_backend = RedisLeaseBackend(redis_client(backend, redis.Redis), owns_client=owns)
    else:
        raise ConfigurationError(
            f"lease_node needs a redis-py client, a SQLAlchemy Engine or a URL; got {backend!r}"
        )
    owner = _owner_token()
    acquired_at_s = monotonic()
    try:
        node = lease_backend.try_acquire(pool, names, owner, int(ttl_s * 1000))
    except BaseException:
        lease_backend.close()
        raise
    if node is None:
        lease_backend.close()
        raise ConfigurationError(
            f"all {len(names)} node ids of pool {pool!r} are leased by live processes; "
            "widen `nodes` or stop some processes"
        )
    return NodeLease(
        lease_backend,
        pool=pool,
        node=node,
        owner=owner,
        ttl_s=ttl_s,
        acquired_at_s=acquired_at_s,
        on_lost=on_lost,
        release_hold_s=release_hold_s,
        monotonic=monotonic,
        renew_in_background=renew_in_background,
    )
