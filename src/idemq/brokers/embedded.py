"""``embedded://path/queue.db``: a small at-least-once queue in one SQLite file — local use only.

For the demo and for tests without servers; not a production broker (one file, polling, no
fan-out). No maintained library offered what idemq needs here (litequeue has no visibility
timeout nor attempt counter; persist-queue only resumes unacked items when a process restarts),
so this file keeps its own, deliberately small:

* receive = one ``BEGIN IMMEDIATE`` transaction that hides a row until ``now + visibility
  timeout`` and stamps a fresh receipt, so two processes never get the same row at once;
* a consumer that dies (even SIGKILL) simply never settles: the row becomes visible again when
  the timeout runs out, with ``attempts`` incremented — the redelivery the guard must absorb
  (``attempts`` counts receives; idemq's attempt number is the ``idemq-delivery-attempt``
  header, which only a retry after a failed handler run bumps, in the same UPDATE);
* ack/retry/dead-letter only act if the receipt still matches: a consumer whose visibility ran
  out cannot ack the copy another consumer now holds;
* dead letters go to queue ``<queue>.dlq`` in the same file, in the same transaction as the
  delete, so a poison message is never lost nor duplicated.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import ClassVar
from urllib.parse import parse_qs, urlsplit

from idemq._clock import Clock, system_clock_ms
from idemq.brokers.base import Delivery, Received, Traits, outgoing_headers
from idemq.errors import BrokerUnavailableError, ConfigurationError

__all__ = ["EmbeddedBroker"]

log = logging.getLogger("idemq.brokers.embedded")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS idemq_queue (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    queue TEXT NOT NULL,
    body BLOB NOT NULL,
    headers TEXT NOT NULL,
    visible_at_ms INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    receipt TEXT
);
CREATE INDEX IF NOT EXISTS idemq_queue_ready ON idemq_queue (queue, visible_at_ms);
"""


class EmbeddedBroker:
    """SQLite-file queue with visibility timeout, attempts counter and a dead-letter queue."""

    TRAITS: ClassVar[Traits] = Traits(redelivery_timers=(("visibility_timeout_s", 1),))

    def __init__(
        self,
        path: str | Path,
        *,
        visibility_timeout_s: float = 30.0,
        poll_interval_s: float = 0.05,
        clock_ms: Clock = system_clock_ms,
    ) -> None:
        self.path = Path(path)
        self.visibility_timeout_ms = int(visibility_timeout_s * 1000)
        self.poll_interval_s = poll_interval_s
        self._clock_ms = clock_ms
        self._lock = threading.Lock()  # one connection shared by the consumer and settling threads
        self._closed = threading.Event()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA busy_timeout=10000")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise BrokerUnavailableError(f"cannot open embedded queue {self.path}: {exc}") from exc

    @classmethod
    def from_url(cls, url: str) -> EmbeddedBroker:
        """From ``embedded:///abs/q.db`` or ``embedded://rel/q.db`` (``?visibility_timeout_s=``)."""
        parts = urlsplit(url)
        path = (parts.netloc + parts.path) if parts.netloc else parts.path
        if not path:
            raise ConfigurationError(f"embedded broker URL needs a file path: {url!r}")
        query = parse_qs(parts.query)
        try:
            visibility_timeout_s = float(query.get("visibility_timeout_s", ["30"])[0])
            poll_interval_s = float(query.get("poll_interval_s", ["0.05"])[0])
        except ValueError as exc:
            raise ConfigurationError(f"bad number in embedded broker URL {url!r}") from exc
        return cls(path, visibility_timeout_s=visibility_timeout_s, poll_interval_s=poll_interval_s)

    def declare(self, queue: str) -> None:
        """Nothing to do: every queue of the file exists implicitly."""

    def delete_queue(self, queue: str) -> None:
        """Delete every message of ``queue`` and of its dead-letter queue."""
        self._run(
            "DELETE FROM idemq_queue WHERE queue IN (?, ?)", (queue, self.dead_letter_queue(queue))
        )

    def dead_letter_queue(self, queue: str) -> str:
        """Dead letters of ``queue`` live in ``<queue>.dlq`` of the same file."""
        return f"{queue}.dlq"

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
    ) -> None:
        """Append a message (committed when this returns)."""
        all_headers = outgoing_headers(headers, message_id)
        self._run(
            "INSERT INTO idemq_queue (queue, body, headers, visible_at_ms) VALUES (?, ?, ?, ?)",
            (queue, body, json.dumps(all_headers), self._clock_ms()),
        )

    def consume(self, queue: str, *, prefetch: int = 1) -> Iterator[Delivery | None]:
        """Receive one message at a time (``prefetch`` is moot: nothing is buffered)."""
        while not self._closed.is_set():
            delivery = self._receive(queue)
            if delivery is None:
                self._closed.wait(self.poll_interval_s)
            yield delivery

    def depth(self, queue: str) -> int:
        """How many messages ``queue`` holds, visible or not (for tests and the demo)."""
        with self._lock:
            row = self._db.execute(
                "SELECT COUNT(*) FROM idemq_queue WHERE queue = ?", (queue,)
            ).fetchone()
        return int(row[0])

    def close(self) -> None:
        """Stop consuming and close the file; unsettled messages reappear after the timeout."""
        self._closed.set()
        with self._lock:
            self._db.close()

    # -- internals ---------------------------------------------------------------------------

    def _receive(self, queue: str) -> EmbeddedDelivery | None:
        now_ms = self._clock_ms()
        receipt = uuid.uuid4().hex
        with self._lock:
            try:
                # IMMEDIATE takes the write lock up front: two processes cannot pick the same row.
                self._db.execute("BEGIN IMMEDIATE")
                row = self._db.execute(
                    "SELECT seq, body, headers, attempts FROM idemq_queue"
                    " WHERE queue = ? AND visible_at_ms <= ? ORDER BY seq LIMIT 1",
                    (queue, now_ms),
                ).fetchone()
                if row is not None:
                    self._db.execute(
                        "UPDATE idemq_queue SET visible_at_ms = ?, attempts = attempts + 1,"
                        " receipt = ? WHERE seq = ?",
                        (now_ms + self.visibility_timeout_ms, receipt, row[0]),
                    )
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                raise BrokerUnavailableError(f"embedded queue receive failed: {exc}") from exc
        if row is None:
            return None
        seq, body, headers_json, _receives = row
        headers: dict[str, str] = json.loads(headers_json)
        received = Received.build(queue, bytes(body), headers)
        return EmbeddedDelivery(self, received, seq=seq, receipt=receipt)

    def _settle(
        self, seq: int, receipt: str, statements: list[tuple[str, tuple[object, ...]]]
    ) -> bool:
        """Run ``statements`` in one transaction if ``receipt`` still holds row ``seq``."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                held = self._db.execute(
                    "SELECT 1 FROM idemq_queue WHERE seq = ? AND receipt = ?", (seq, receipt)
                ).fetchone()
                if held is not None:
                    for sql, params in statements:
                        self._db.execute(sql, params)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                raise BrokerUnavailableError(f"embedded queue settle failed: {exc}") from exc
        return held is not None

    def _run(self, sql: str, params: tuple[object, ...]) -> None:
        with self._lock:
            try:
                self._db.execute(sql, params)
            except sqlite3.Error as exc:
                raise BrokerUnavailableError(f"embedded queue write failed: {exc}") from exc

    def _rollback(self) -> None:
        try:
            self._db.execute("ROLLBACK")
        except sqlite3.Error:
            log.debug("rollback after a failed statement failed too", exc_info=True)

    def now_ms(self) -> int:
        """The broker's clock (injected in tests)."""
        return self._clock_ms()


class EmbeddedDelivery(Delivery):
    """A row held under a receipt until its visibility timeout."""

    def __init__(
        self, broker: EmbeddedBroker, received: Received, *, seq: int, receipt: str
    ) -> None:
        super().__init__(received)
        self._broker = broker
        self._seq = seq
        self._receipt = receipt

    def _ack(self) -> None:
        self._apply("ack", [("DELETE FROM idemq_queue WHERE seq = ?", (self._seq,))])

    def _retry(self, delay_s: float, counted: bool) -> None:
        visible_at_ms = self._broker.now_ms() + int(delay_s * 1000)
        headers = json.dumps(self.retry_headers(counted=counted))
        self._apply(
            "retry",
            [
                (
                    "UPDATE idemq_queue SET visible_at_ms = ?, headers = ?, receipt = NULL"
                    " WHERE seq = ?",
                    (visible_at_ms, headers, self._seq),
                )
            ],
        )

    def _dead_letter(self, reason: str) -> None:
        # One SQLite transaction moves it (the base's copy-then-settle is for brokers that
        # cannot), and only while this consumer still holds the receipt.
        headers = self.dead_letter_copy_headers(reason)
        dlq = self._broker.dead_letter_queue(self.queue)
        self._apply(
            "dead_letter",
            [
                (
                    "INSERT INTO idemq_queue (queue, body, headers, visible_at_ms)"
                    " VALUES (?, ?, ?, ?)",
                    (dlq, self.body, json.dumps(headers), self._broker.now_ms()),
                ),
                ("DELETE FROM idemq_queue WHERE seq = ?", (self._seq,)),
            ],
        )

    def _apply(self, what: str, statements: list[tuple[str, tuple[object, ...]]]) -> None:
        if not self._broker._settle(self._seq, self._receipt, statements):
            # The visibility timeout ran out and another consumer holds the row now; it will
            # settle it (and the guard turns its copy into a DUPLICATE). Say so rather than hide it.
            log.warning(
                "%s of %s ignored: visibility timeout expired, another consumer holds it",
                what,
                self.describe(),
            )
