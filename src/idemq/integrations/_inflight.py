"""How a request learns, on PostgreSQL, that the first request of its key is still running:
a transaction-scoped advisory lock on the key, tried before the claim.

Why a lock of its own: the claim's ``INSERT … ON CONFLICT DO NOTHING`` that meets the first
request's row before that request committed waits for its transaction to end, however long the
handler runs. ``wait_s=0`` promises a 409 at once instead. Each guarded request therefore tries
``pg_try_advisory_xact_lock`` on its key first, in the transaction the claim then runs in:

* the lock is held until the first request's COMMIT or ROLLBACK, so a second request finds it
  taken and is answered 409 without reaching the row (nothing written, nothing waited for);
* the lock is free once the first request ended: the claim that follows finds a committed row
  (a replay) or none (the first rolled back: this request runs), and never waits;
* it changes no setting of the connection, so the app's own writes wait for their row locks as
  they always do (a ``SET LOCAL lock_timeout`` before the claim had to be undone after it);
* ``wait_s > 0``: the lock is tried again, backing off, until ``wait_s`` has passed.

A key is hashed to 32 bits (the two-int lock form keeps these locks in a space of their own,
apart from the application's advisory locks and the outbox's). Two keys in flight at the same
instant share a lock once in four billion pairs: the later request gets a 409 it did not need,
and its client's retry goes through. Other databases have no transaction-scoped advisory lock:
there the claim waits as the server's own lock timeout says.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator

from idemq._backoff import Backoff

__all__ = ["LOCK_SPACE", "lock_pauses", "try_lock_sql"]

LOCK_SPACE = 0x1DE4
"""The first half of the two-int advisory lock key of a key in flight (the outbox's is 0x1DE3)."""

# Doubling from 10 ms up to 250 ms, no jitter: the waiter is one request polling one lock.
_PAUSES = Backoff(first_s=0.01, max_s=0.25)


def try_lock_sql(consumer: str, message_id: str) -> str:
    """The statement that tries the lock of ``message_id`` (its 32-bit hash is a literal, so
    the text runs on any driver's cursor without a parameter style); it returns one boolean."""
    digest = hashlib.sha256(f"{consumer}\0{message_id}".encode("utf-8", "surrogatepass"))
    key = int.from_bytes(digest.digest()[:4], "big", signed=True)
    return f"SELECT pg_try_advisory_xact_lock({LOCK_SPACE}, {key})"


def lock_pauses(wait_s: float, now: Callable[[], float] = time.monotonic) -> Iterator[float]:
    """The pauses before each further try of a taken lock (idemq's one :class:`Backoff`,
    10 ms doubling up to 250 ms), until ``wait_s`` (from the first call of ``next``) has
    passed; none when ``wait_s`` is 0."""
    deadline = now() + wait_s
    attempt = 1
    while (left_s := deadline - now()) > 0:
        yield min(_PAUSES.delay_s(attempt), left_s)
        attempt += 1
