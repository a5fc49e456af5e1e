"""``OutboxRelay``: publish committed outbox rows, with confirms; forget them only after.

One batch, on PostgreSQL and MySQL/MariaDB::

    BEGIN
    SELECT … WHERE due AND head-of-its-key ORDER BY seq LIMIT n FOR UPDATE SKIP LOCKED
    publish each row, waiting for the broker's confirm
    DELETE (or mark sent) the confirmed rows; count an attempt on the refused ones
    COMMIT

A relay killed anywhere before COMMIT leaves its rows as they were (the server drops its locks
with its connection): the next relay publishes them again, with the same message id, and the
consumer's dedup row absorbs the copy. Relays running side by side skip each other's locked
rows, so none is published twice except after such a crash.

SQLite has no row locks: a batch first leases its rows (``lease_owner``/``lease_until_ms`` in
one short write transaction), publishes, then deletes only the rows it still holds. While it
publishes it keeps the leases (renewed every third of ``lease_s``), and right before each publish
it renews that row's lease and publishes it only if it still holds it
(:class:`~idemq.outbox.leases.RowLeases`): a publish slower than the lease does not let another
relay send the same rows.

Ordering. A row is claimable only when no earlier (lower ``seq``) unsent row of its
``ordering_key`` exists in the claiming statement's view. Relay B, looking while relay A holds
row k#1, sees k#1 and so never takes k#2; once A's COMMIT deletes k#1, k#2 is the head. So rows
of one key are published in ``seq`` order, each only after every earlier one was confirmed —
whatever the number of relays. ``seq`` order is commit order for rows of one key: PostgreSQL's
``add`` holds a transaction lock on the key until commit (two writers of one key serialise),
SQLite has one writer at a time; on MySQL/MariaDB it holds when the writers of a key serialise
on a row of their own (the business row of that order, say) before they ``add``.

Failures. A refused publish (:class:`~idemq.errors.BrokerRefusedError`: a full queue that
rejects publishes, no queue or stream for the destination, a body or headers over the broker's
limits; or any other error but :class:`~idemq.errors.BrokerUnavailableError`) counts an attempt
and waits ``backoff_s * 2**attempts`` (at most ``max_backoff_s``); after ``max_attempts`` the row
moves to ``<table>_dead`` with the reason. Until then it holds back the later rows of its own key
only. An unreachable broker counts no attempt, however long it lasts: the batch stops, the relay
reconnects, and every row waits for it.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Row

from idemq._backoff import Backoff
from idemq._clock import system_clock_ms
from idemq._outage import Outage
from idemq.brokers import open_broker
from idemq.brokers.base import Broker
from idemq.drivers.sql import DriverStatement, Step, run_step, translated
from idemq.errors import (
    BrokerError,
    BrokerUnavailableError,
    ConfigurationError,
    StoreError,
)
from idemq.outbox.admin import cleanup
from idemq.outbox.leases import RowLeases
from idemq.outbox.outbox import Outbox
from idemq.outbox.statements import Statements

__all__ = ["BatchResult", "OutboxRelay"]

log = logging.getLogger("idemq.relay")


@dataclass(slots=True)
class BatchResult:
    """What one batch did."""

    claimed: int = 0
    published: list[str] = field(default_factory=list)
    retried: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    refused: dict[str, tuple[int, str]] = field(default_factory=dict)  # id -> (attempts, reason)
    lost: list[str] = field(default_factory=list)  # SQLite: leases another relay took over
    outage: BrokerUnavailableError | None = None

    def merge(self, other: BatchResult) -> None:
        """Add ``other`` (a later round of the same batch) to this one."""
        self.claimed += other.claimed
        self.published += other.published
        self.retried += other.retried
        self.dead += other.dead
        self.refused.update(other.refused)
        self.lost += other.lost
        self.outage = other.outage or self.outage


class OutboxRelay:
    """Publishes an :class:`~idemq.Outbox`'s rows to ``broker`` (a URL or a :class:`Broker`).

    ``batch_size`` rows per transaction; ``max_attempts`` refusals before a row is dead;
    ``keep_sent_s`` > 0 keeps sent rows that long (audit) instead of deleting them;
    ``poll_s`` bounds how long an idle relay waits (PostgreSQL relays wake on NOTIFY sooner);
    ``lease_s`` is the claim length on SQLite; ``clock`` returns epoch ms.
    """

    def __init__(
        self,
        outbox: Outbox,
        broker: str | Broker,
        *,
        batch_size: int = 100,
        max_attempts: int = 10,
        backoff_s: float = 1.0,
        max_backoff_s: float = 300.0,
        keep_sent_s: float = 0.0,
        poll_s: float = 1.0,
        lease_s: float = 30.0,
        cleanup_every_s: float = 10.0,
        cleanup_batch: int = 1000,
        clock: Callable[[], int] = system_clock_ms,
    ) -> None:
        self.outbox = outbox
        self._broker_url = broker if isinstance(broker, str) else None
        self._broker: Broker | None = None if isinstance(broker, str) else broker
        self.batch_size = max(1, batch_size)
        self.max_attempts = max(1, max_attempts)
        # A refused row waits backoff_s, doubling with each further refusal.
        self.backoff = Backoff(backoff_s, max_backoff_s)
        self.keep_sent_s = keep_sent_s
        self.poll_s = poll_s
        self.lease_s = lease_s
        self.cleanup_every_s = cleanup_every_s
        self.cleanup_batch = cleanup_batch
        self.clock = clock
        self.owner = secrets.token_hex(8)
        self.published_total = 0
        self.dead_total = 0
        self._conn: Connection | None = None
        self._next_cleanup_ms = 0

    def __repr__(self) -> str:
        return f"OutboxRelay({self.outbox.where!r})"

    # -- one batch ---------------------------------------------------------------------------

    def run_once(self) -> BatchResult:
        """Claim, publish and settle one batch; see the module docstring."""
        sql = self.outbox.statements(self.outbox.engine.dialect)
        # Connected before any row is claimed: a broker that cannot be reached (or a bad URL)
        # must not count as a refusal of the rows.
        self._open_broker()
        try:
            with translated(f"relay of {self.outbox.table}"):
                if sql.lease:
                    return self._leased_batch(sql)
                return self._locked_batch(sql)
        except StoreError:
            # Its connection may be the one that failed: the next batch opens a fresh one.
            self._drop_connection()
            raise

    def _locked_batch(self, sql: Statements) -> BatchResult:
        conn = self._connection()
        total = BatchResult()
        with conn.begin():
            # Rounds inside one transaction: this relay's own deletes make the next row of a key
            # the head *for it*, while every other relay still sees the deleted rows (not yet
            # committed) and keeps off the key.
            while total.claimed < self.batch_size:
                limit = self.batch_size - total.claimed
                rows = self._run(conn, sql.claim, {"now_ms": self.clock(), "limit": limit})
                result = self._publish(rows)
                self._settle(conn, sql, result, {})
                total.merge(result)
                keyed = any(row.ordering_key is not None for row in rows)
                if not rows or result.outage is not None or (len(rows) < limit and not keyed):
                    break
        return total

    def _leased_batch(self, sql: Statements) -> BatchResult:
        now = self.clock()
        mine = {"owner": self.owner}
        params = {**mine, "now_ms": now, "until_ms": now + int(self.lease_s * 1000)}
        engine = self.outbox.engine
        with engine.begin() as conn:
            rows = self._run(conn, sql.claim, {**params, "limit": self.batch_size})
        ids = [row.id for row in rows]
        # Kept until the settle has committed: a lease running out between the last confirm
        # and the delete would let another relay publish a row already sent.
        with RowLeases(engine, sql, self.owner, self.lease_s, self.clock, ids) as keeper:
            result = self._publish(sorted(rows, key=lambda row: int(row.seq)), keeper.fence)
            with engine.begin() as conn:
                self._settle(conn, sql, result, mine)
                # The rows an outage stopped the batch before: free at once, not a lease later,
                # so the broker's return is not followed by a lease of silence.
                done = {*result.published, *result.refused, *result.lost}
                untried = [row_id for row_id in ids if row_id not in done]
                if untried and sql.release_leases is not None:
                    conn.execute(sql.release_leases, {"ids": untried, **mine})
        return result

    def _publish(
        self, rows: Sequence[Row[Any]], fence: Callable[[str], bool] | None = None
    ) -> BatchResult:
        """Publish ``rows`` in order; ``fence`` (SQLite) says whether a row is still this
        relay's right before its publish."""
        result = BatchResult(claimed=len(rows))
        broker = self._open_broker()
        for row in rows:
            if fence is not None and not fence(row.id):
                result.lost.append(row.id)
                log.warning("outbox row %s was taken over by another relay; left to it", row.id)
                continue
            try:
                headers = json.loads(row.headers) if row.headers else {}
                broker.publish(row.destination, bytes(row.body), headers=headers, message_id=row.id)
            except BrokerUnavailableError as exc:
                # This row and the rest wait for the broker: no attempt is counted.
                result.outage = exc
                break
            except Exception as exc:  # any refusal is recorded on the row
                reason = f"{type(exc).__name__}: {exc}"[:2000]
                result.refused[row.id] = (int(row.attempts), reason)
                if int(row.attempts) + 1 >= self.max_attempts:
                    result.dead.append(row.id)
                else:
                    result.retried.append(row.id)
            else:
                result.published.append(row.id)
        return result

    def _settle(
        self, conn: Connection, sql: Statements, result: BatchResult, mine: dict[str, str]
    ) -> None:
        now = self.clock()
        if result.published:
            if self.keep_sent_s > 0:
                self._run(conn, sql.mark_sent, {"ids": result.published, "now_ms": now, **mine})
            elif sql.delete_leased is not None:
                self._run(conn, sql.delete_leased, {"ids": result.published, **mine})
            else:
                self._run(conn, sql.delete_sent, {"ids": result.published})
        for row_id in result.retried:
            attempts, reason = result.refused[row_id]
            delay_s = self.backoff.delay_s(attempts + 1)
            params = {"id": row_id, "counted": 1, "error": reason, **mine}
            conn.execute(sql.fail, {**params, "next_ms": now + int(delay_s * 1000)})
        for row_id in result.dead:
            _attempts, reason = result.refused[row_id]
            moved = conn.execute(
                sql.to_dead, {"id": row_id, "error": reason, "now_ms": now, **mine}
            )
            if moved.rowcount:
                conn.execute(sql.delete_one, {"id": row_id})
            log.error("outbox row %s dead after %d attempts: %s", row_id, self.max_attempts, reason)
        self.published_total += len(result.published)
        self.dead_total += len(result.dead)

    # -- the loop ----------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None, outage: Outage | None = None) -> None:
        """Relay until ``stop`` is set: full batches back to back, then wait for a NOTIFY
        (PostgreSQL) or ``poll_s``. An outage of the broker or the store is waited out as
        ``outage`` says (default: never give up; ``idemq worker --relay`` passes the worker's
        own give-up time): when it gives up, its error is raised. A
        :class:`~idemq.ConfigurationError` (a store that refuses the login, say) before the
        first batch is raised at once."""
        stop = stop or threading.Event()
        outage = outage or Outage(None, stop)
        waiter = _waiter_for(self.outbox)
        started = False
        try:
            while not stop.is_set():
                outage.attempting()
                try:
                    result = self.run_once()
                    self.cleanup_if_due()
                except (StoreError, BrokerError) as exc:
                    if isinstance(exc, ConfigurationError) and not started:
                        # A refused login, an unknown database or table before the first
                        # batch: the same settings fail the same way, no wait helps (the CLI
                        # exits 2). Once running, it is waited out like an outage.
                        raise
                    failure: StoreError | BrokerError | None = exc
                else:
                    started = True
                    failure = result.outage
                if failure is not None:
                    self._drop_broker()
                    outage.failed(failure, f"relaying {self.outbox.where}")
                    continue
                outage.over()
                if result.claimed < self.batch_size:
                    waiter.wait(self.poll_s, stop)
        finally:
            waiter.close()

    # -- retention and inspection ------------------------------------------------------------

    def cleanup_if_due(self) -> int:
        """:meth:`cleanup` at most every ``cleanup_every_s`` (only when sent rows are kept)."""
        now = self.clock()
        if self.keep_sent_s <= 0 or now < self._next_cleanup_ms:
            return 0
        self._next_cleanup_ms = now + int(self.cleanup_every_s * 1000)
        return self.cleanup()

    def cleanup(self) -> int:
        """Delete rows sent more than ``keep_sent_s`` ago, ``cleanup_batch`` per transaction."""
        return cleanup(
            self.outbox, keep_sent_s=self.keep_sent_s, batch=self.cleanup_batch, now_ms=self.clock()
        )

    def close(self) -> None:
        """Close the relay's database connection and, if it opened it, the broker."""
        self._drop_connection()
        self._drop_broker()

    # -- plumbing ----------------------------------------------------------------------------

    def _run(self, conn: Connection, statement: DriverStatement, params: dict[str, Any]) -> Any:
        """The rows of ``statement`` run on the driver's cursor (errors translated)."""
        return run_step(conn, Step(statement, params), f"relay of {self.outbox.table}").rows

    def _connection(self) -> Connection:
        if self._conn is None or self._conn.closed or self._conn.invalidated:
            conn = self.outbox.engine.connect()
            if conn.dialect.name in ("mysql", "mariadb"):
                # No gap locks: REPEATABLE READ's next-key locks on the claim's range would
                # hold back every add() until the batch commits.
                conn = conn.execution_options(isolation_level="READ COMMITTED")
            self._conn = conn
        return self._conn

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _open_broker(self) -> Broker:
        if self._broker is None:
            assert self._broker_url is not None
            self._broker = open_broker(self._broker_url)
        return self._broker

    def _drop_broker(self) -> None:
        # Only a broker this relay opened is closed (and reopened on the next batch).
        if self._broker is not None and self._broker_url is not None:
            try:
                self._broker.close()
            except Exception:  # a dead connection may fail to close; drop it
                log.debug("closing the broker failed", exc_info=True)
            self._broker = None


class _Waiter:
    """How an idle relay waits: ``poll_s`` (every database but PostgreSQL)."""

    def wait(self, timeout_s: float, stop: threading.Event) -> None:
        stop.wait(timeout_s)

    def close(self) -> None:
        return None


class _ListenWaiter(_Waiter):
    """PostgreSQL: LISTEN on the outbox's channel; ``add`` NOTIFYs at commit."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self._conn: Connection | None = None

    def _listen(self) -> Connection:
        if self._conn is None:
            conn = self.outbox.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            channel = conn.dialect.identifier_preparer.quote(self.outbox.table)
            conn.exec_driver_sql(f"LISTEN {channel}")
            self._conn = conn
        return self._conn

    def wait(self, timeout_s: float, stop: threading.Event) -> None:
        # Bounded: ``stop`` is looked at every ``timeout_s`` even when no NOTIFY comes.
        try:
            driver = self._listen().connection.driver_connection
            for _note in driver.notifies(timeout=timeout_s, stop_after=1):  # type: ignore[union-attr]
                break
        except Exception:  # a lost LISTEN connection falls back to polling
            log.debug("LISTEN failed; polling", exc_info=True)
            self.close()
            stop.wait(timeout_s)

    def close(self) -> None:
        if self._conn is not None:
            try:
                # The connection goes back to the pool: it must not keep listening there.
                self._conn.exec_driver_sql("UNLISTEN *")
                self._conn.close()
            except Exception:  # closing a broken connection may fail
                log.debug("closing the LISTEN connection failed", exc_info=True)
            self._conn = None


def _waiter_for(outbox: Outbox) -> _Waiter:
    if outbox.engine.dialect.name == "postgresql" and outbox.engine.dialect.driver == "psycopg":
        return _ListenWaiter(outbox)
    return _Waiter()
