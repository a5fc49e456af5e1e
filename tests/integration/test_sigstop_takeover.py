"""A worker process frozen (SIGSTOP) past its lease, on Redis and on PostgreSQL.

Worker A is a real separate process: a guard in lease mode with renewal (``lease_s=2``), whose
handler reads the account's version at claim time and then waits to be told its lease is lost.
The test freezes A, waits until a second guard (this process) takes the message over and makes
the effect — a versioned write of the account — then lets A go on (SIGCONT). A's renewal then
finds the claim gone: its handler is told (``current_message().lease_lost`` and
``wait_lease_lost()``), its own write, a compare-and-set on the version it read at claim time,
is rejected, and its ``complete`` is refused with LeaseLostError. The account shows exactly one
effect.

Time margins are generous (a loaded 2-core machine): every wait is polled up to a deadline.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from tests.conftest import PG_URL, REDIS_URL, redis_cleanup, require_service, unique

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 3.0  # renewed every second: two seconds of slack on a loaded machine

WORKER = textwrap.dedent(
    """
    import sys
    import sqlalchemy as sa
    import idemq
    from idemq.guard.context import current_message

    kind, where, accounts, consumer, pg_url, redis_url, lease_s = sys.argv[1:8]
    if kind == "redis":
        store = idemq.RedisStore(redis_url, prefix=where, ttl_s=600)
    else:
        store = idemq.SqlStore(pg_url, table=where)
    engine = sa.create_engine(pg_url)
    guard = idemq.Idempotency(store, consumer=consumer, mode="lease", lease_s=float(lease_s))

    def say(*words):
        print(*words, flush=True)

    def handler(_tx):
        with engine.connect() as conn:
            version = conn.execute(
                sa.text(f"SELECT version FROM {accounts} WHERE id = 1")
            ).scalar_one()
        say("CLAIMED", version)
        context = current_message()
        told = context.wait_lease_lost(120)
        say("TOLD", told, context.lease_lost)
        with engine.begin() as conn:
            wrote = idemq.versioned_update(
                conn, accounts, "id", 1, version, {"balance": 100}
            )
        say("WROTE", wrote)
        return "from A"

    try:
        outcome = guard.process("M1", handler)
        say("OUTCOME", outcome.status.value)
    except idemq.LeaseLostError:
        say("COMPLETE LeaseLostError")
    """
)


class Worker:
    """Worker A: a child process whose lines are read one at a time, with a deadline."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER, *args],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for text in self.process.stdout:
            self.lines.put(text)
        self.lines.put(None)  # end of output

    def line(self, timeout_s: float = 60.0) -> list[str]:
        """The child's next line, split; fails the test if none comes in ``timeout_s``."""
        try:
            text = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"worker A said nothing in {timeout_s} s") from None
        assert text is not None, "worker A exited early"
        return text.split()

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        self.process.wait(10)
        self.reader.join(10)
        assert self.process.stdout is not None
        self.process.stdout.close()


@pytest.fixture(params=["redis", "postgres"])
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, str, sa.Engine]]:
    kind: str = request.param
    require_service("postgres")
    if kind == "redis":
        require_service("redis")
        where = unique("idemqstop")
        store: Any = idemq.RedisStore(REDIS_URL, prefix=where, ttl_s=600)
    else:
        where = unique("mi")
        store = idemq.SqlStore(PG_URL, table=where)
        store.create_schema()
    accounts = unique("acct")
    engine = sa.create_engine(PG_URL)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f"CREATE TABLE {accounts} (id INTEGER PRIMARY KEY, balance BIGINT NOT NULL, "
                "version INTEGER NOT NULL)"
            )
        )
        conn.execute(sa.text(f"INSERT INTO {accounts} VALUES (1, 0, 0)"))
    yield kind, store, accounts, engine
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {accounts}"))
    engine.dispose()
    if kind == "redis":
        redis_cleanup(where)
    else:
        store.drop_schema()
    store.close()


def take_over(guard: idemq.Idempotency, handler: Any, timeout_s: float = 60.0) -> Any:
    """Deliver M1 to ``guard`` until its answer is not IN_PROGRESS (the frozen lease ran out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outcome = guard.process("M1", handler)
        if outcome.status is not idemq.Status.IN_PROGRESS:
            return outcome
        time.sleep(0.2)
    raise AssertionError(f"the frozen worker's lease did not run out in {timeout_s} s")


@pytest.mark.timeout(240)
def test_a_frozen_worker_is_taken_over_told_refused_and_fenced(setup):
    kind, store, accounts, engine = setup
    consumer = unique("c")
    where = store.prefix if kind == "redis" else store.table.name
    worker = Worker([kind, where, accounts, consumer, PG_URL, REDIS_URL, str(LEASE_S)])
    try:
        assert worker.line() == ["CLAIMED", "0"]
        time.sleep(1.5 * LEASE_S)  # past A's first lease: only its renewals keep it live
        guard = idemq.Idempotency(store, consumer=consumer, mode="lease", lease_s=30)
        assert guard.process("M1", lambda _tx: "B ran early").status is idemq.Status.IN_PROGRESS

        worker.signal(signal.SIGSTOP)
        runs: list[str] = []

        def effect(_tx: Any) -> str:
            runs.append("B")
            with engine.connect() as conn:
                version = conn.execute(
                    sa.text(f"SELECT version FROM {accounts} WHERE id = 1")
                ).scalar_one()
            with engine.begin() as conn:
                assert idemq.versioned_update(conn, accounts, "id", 1, version, {"balance": 100})
            return "from B"

        taken = take_over(guard, effect)
        assert taken.status is idemq.Status.PROCESSED
        assert runs == ["B"]

        worker.signal(signal.SIGCONT)
        assert worker.line() == ["TOLD", "True", "True"]  # wait_lease_lost(), lease_lost
        assert worker.line() == ["WROTE", "False"]  # its compare-and-set met B's version
        assert worker.line() == ["COMPLETE", "LeaseLostError"]
        assert worker.process.wait(30) == 0
    finally:
        worker.stop()

    with engine.connect() as conn:
        balance, version = conn.execute(
            sa.text(f"SELECT balance, version FROM {accounts} WHERE id = 1")
        ).one()
    assert (balance, version) == (100, 1)  # one effect: B's
    record = store.get("M1", consumer)
    assert record is not None
    assert record.status is idemq.RecordStatus.PROCESSED
    assert guard.process("M1", lambda _tx: runs.append("again")).result == "from B"
    assert runs == ["B"]
