"""Connections a SQL store keeps checked out between its own transactions.

Checking a connection out of SQLAlchemy's pool and back in costs ~20 µs of CPU per transaction
(pool bookkeeping, the ``Connection`` object, the return to the queue): on SQLite that is more
than the claim itself, on PostgreSQL and MariaDB several percent of a message. A store therefore
keeps the ``Connection`` of a transaction that ended cleanly and hands it to its next one.

It never holds more than the pool would keep open anyway:

* only with a ``QueuePool`` and at most its ``pool_size`` — a ``NullPool`` (e.g. behind
  PgBouncer) or a ``StaticPool`` is used as configured, and overflow connections still close;
* not when the pool checks connections on checkout (``pool_pre_ping``, ``pool_recycle``): those
  checks would be skipped for a kept connection;
* only a connection whose transaction committed or rolled back without error and that the handler
  left as it found it (not closed, not invalidated, no transaction open, no execution options);
* a disconnect seen on any connection drops them all (the database probably restarted; the pool
  replaces them on its next checkout);
* after ``os.fork()`` the child never uses the parent's connections (their sockets are shared).
"""

from __future__ import annotations

import os
from typing import Generic, TypeVar

from sqlalchemy.pool import Pool, QueuePool

__all__ = ["IdleConnections", "keep_limit"]

C = TypeVar("C")


def keep_limit(pool: Pool) -> int:
    """How many idle connections a store may keep checked out of ``pool`` (0: none)."""
    if not isinstance(pool, QueuePool):
        return 0
    # Private, but the only place these settings live; a pool that checks each checkout must
    # see every checkout.
    if getattr(pool, "_pre_ping", True) or getattr(pool, "_recycle", 0) >= 0:
        return 0
    return pool.size()


class IdleConnections(Generic[C]):
    """A LIFO of idle connections (the most recently used is the warmest), safe across threads.

    ``list.append``/``list.pop`` are atomic, so no lock is taken on the per-message path; two
    threads racing past the length check can exceed the limit by one each, never unboundedly
    (each holds a connection it was using anyway).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._idle: list[C] = []
        self._pid = os.getpid()
        # The parent's connections, kept referenced in a forked child: collecting them would
        # return them to the pool, which may close them — on a socket the parent still uses.
        self._inherited: list[C] = []

    def take(self) -> C | None:
        """An idle connection, or ``None`` (check one out of the pool)."""
        if self._pid != os.getpid():
            self._inherited += self._idle
            self._idle = []
            self._pid = os.getpid()
        try:
            return self._idle.pop()
        except IndexError:
            return None

    def keep(self, conn: C) -> bool:
        """Keep ``conn`` for the next transaction; ``False``: the caller closes it."""
        if len(self._idle) >= self.limit or self._pid != os.getpid():
            return False
        self._idle.append(conn)
        return True

    def drain(self) -> list[C]:
        """Every idle connection, for the caller to close (disconnect seen, store closed)."""
        drained: list[C] = []
        while True:  # pop one by one: a connection kept meanwhile is drained too, never lost
            try:
                drained.append(self._idle.pop())
            except IndexError:
                return drained
