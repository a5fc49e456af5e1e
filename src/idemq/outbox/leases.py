"""SQLite's relay holds its rows by leases; :class:`RowLeases` keeps them while it publishes
(not the guard's :class:`~idemq.guard.renewal.LeaseKeeper`: these are outbox rows, renewed in bulk).

Timeline of the double publish this prevents (two relays, one SQLite outbox)::

    relay A  claims r1..r5 (until t+L)  publish r1 … stalled (slow confirm) …  publishes r1..r5
    relay B              t+L: r1..r5 look free → claims them → publishes r1..r5
                                              → r1..r5 reach the broker twice

No crash, no pause of the process: only a publish slower than the lease. So while A publishes,
a thread renews the leases of the rows A still holds every third of a lease, and right before
each publish A looks the row up and publishes it only if it still holds it (the fence; a lease
with less than half its length left is renewed there first): a row B took over (A's renewals
failed for a whole lease, or A's clock lags B's) is left to B. The delete after the confirms
removes only the rows A still holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from types import TracebackType

from sqlalchemy import Engine

from idemq.drivers.sql import translated
from idemq.errors import StoreError
from idemq.outbox.statements import Statements

__all__ = ["RowLeases"]

log = logging.getLogger("idemq.relay")


class RowLeases:
    """Renews ``owner``'s leases on ``ids`` every ``lease_s / 3`` until the ``with`` block ends;
    :meth:`fence` renews one row and says whether it is still held."""

    def __init__(  # noqa: PLR0917 - what one batch's leases are made of
        self,
        engine: Engine,
        sql: Statements,
        owner: str,
        lease_s: float,
        clock: Callable[[], int],
        ids: Iterable[str],
    ) -> None:
        assert sql.renew_leases is not None, "leases are SQLite's"
        assert sql.lease_of is not None, "leases are SQLite's"
        self._engine = engine
        self._renew = sql.renew_leases
        self._lease_of = sql.lease_of
        self._owner = owner
        self._lease_ms = int(lease_s * 1000)
        self._period_s = lease_s / 3
        self._clock = clock
        self._held = set(ids)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idemq-relay-leases", daemon=True)

    def __enter__(self) -> RowLeases:
        if self._held:
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _extend(self, ids: list[str]) -> set[str]:
        """Renew the leases on ``ids``; the ids still held (one short write transaction)."""
        params = {"ids": ids, "owner": self._owner, "until_ms": self._clock() + self._lease_ms}
        with translated("renew the relay's row leases"), self._engine.begin() as conn:
            return {row.id for row in conn.execute(self._renew, params)}

    def fence(self, row_id: str) -> bool:
        """Whether this relay still holds ``row_id``, looked up right before its publish: False
        when another relay holds it now (the row is then this relay's no longer: neither
        published nor deleted by it). A lease with less than half its length left (renewals
        lagging) is renewed first, so the publish starts with at least half a lease ahead."""
        with translated(f"read the lease of row {row_id!r}"), self._engine.connect() as conn:
            lease = conn.execute(self._lease_of, {"id": row_id}).first()
        held = lease is not None and lease.lease_owner == self._owner
        if lease is not None and held:
            left_ms = int(lease.lease_until_ms or 0) - self._clock()
            if left_ms < self._lease_ms // 2:
                held = row_id in self._extend([row_id])
        if not held:
            with self._lock:
                self._held.discard(row_id)
        return held

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            with self._lock:
                ids = sorted(self._held)
            if not ids:
                return
            try:
                kept = self._extend(ids)
            except StoreError:
                # A busy or failing database: try again at the next tick; the fence before
                # each publish still refuses a row that was taken over meanwhile.
                log.warning("renewing the relay's leases failed", exc_info=True)
                continue
            with self._lock:
                self._held &= kept
