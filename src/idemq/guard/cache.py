"""A bounded in-process cache of completed records, in front of the store.

Under a redelivery storm most deliveries are duplicates of messages this very process finished a
moment ago; answering those from memory spares the store a round trip each. Only what cannot be
undone is kept: a record the store holds as PROCESSED (read from it, or written by a transaction
idemq itself committed, or a completed lease) — never a live claim, never an effect inside a
caller's transaction that may still roll back. One cache belongs to one guard, so to one
consumer: a message id is never answered for another consumer's record.

Entries are evicted least recently used beyond ``size``, and after ``ttl_ms`` on the guard's
clock, so a record the store has since purged, expired or forgotten is not answered for long.
How long exactly: a ``forget`` through the same guard drops the entry at once; a ``forget``
anywhere else (``idemq forget``, another process's guard, ``store.forget``) is seen by this
cache only when the entry expires, at most ``local_cache_ttl_s`` later
(:data:`DEFAULT_LOCAL_CACHE_TTL_S` unless the guard was given another). Until then a delivery
of the forgotten message to this process is answered DUPLICATE, not run.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from idemq.errors import ConfigurationError
from idemq.stores.base import Record, RecordStatus

__all__ = ["DEFAULT_LOCAL_CACHE_TTL_S", "CompletedCache"]

DEFAULT_LOCAL_CACHE_TTL_S = 30.0
"""How long a completed record is answered from memory by default, and so how long after an
``idemq forget`` elsewhere a guard with ``local_cache=`` may still answer DUPLICATE.

The cache is for redelivery storms — a broker handing back, within seconds, messages this
process finished a moment ago (a consumer restart, an ack or visibility timeout running out) —
and 30 s covers those. A duplicate arriving later costs one claim round trip, no effect; a longer
TTL would save little and keep a forgotten message from running again for longer.
"""


class CompletedCache:
    """Completed records by message id: at most ``size`` of them, each for ``ttl_ms``."""

    def __init__(self, size: int, ttl_ms: int) -> None:
        if size < 1:
            raise ConfigurationError(f"local_cache must be >= 1 records, got {size!r}")
        if ttl_ms < 1:
            raise ConfigurationError(f"local_cache_ttl_s must be positive, got {ttl_ms / 1000!r}")
        self.size = size
        self.ttl_ms = ttl_ms
        self._records: OrderedDict[str, tuple[int, Record]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, message_id: str, now_ms: int) -> Record | None:
        """The completed record of ``message_id`` if it is cached and fresh, else None."""
        with self._lock:
            entry = self._records.get(message_id)
            if entry is None:
                return None
            stored_ms, record = entry
            if now_ms - stored_ms >= self.ttl_ms:
                del self._records[message_id]
                return None
            self._records.move_to_end(message_id)
            return record

    def put(self, record: Record, now_ms: int) -> None:
        """Keep ``record`` (a PROCESSED one only; anything else is ignored)."""
        if record.status is not RecordStatus.PROCESSED:
            return
        with self._lock:
            entry = self._records.get(record.message_id)
            if entry is not None and entry[1] is record:
                # A duplicate answered from this very entry: the store was not asked, so the
                # entry keeps its age. Stamping it again would let a steady stream of
                # duplicates keep a forgotten record answered for ever, not ttl_ms.
                self._records.move_to_end(record.message_id)
                return
            self._records[record.message_id] = (now_ms, record)
            self._records.move_to_end(record.message_id)
            while len(self._records) > self.size:
                self._records.popitem(last=False)

    def forget(self, message_id: str) -> None:
        """Drop ``message_id`` (its record was forgotten in the store)."""
        with self._lock:
            self._records.pop(message_id, None)

    def __len__(self) -> int:
        return len(self._records)
