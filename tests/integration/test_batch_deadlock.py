"""A deadlock inside the batch's isolated rerun, on the real servers.

InnoDB answers a deadlock by rolling the *whole* transaction back, savepoints and all. A batch
that then marked only the deadlocked message FAILED and carried on (the rollback to its savepoint
fails with error 1305) reported an earlier message PROCESSED although its effect was gone, and
committed a later effect without its dedup row. The batch must fail that attempt whole and run
again: every effect once, every PROCESSED outcome committed, every dedup row beside its effect.

How the deadlock is made: a second connection writes many rows (so InnoDB picks the batch, the
smaller transaction, as the victim), locks row B, and once the batch's handler holds row A and
waits for B, asks for A.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from tests.conftest import unique
from tests.contract.conftest import dispose, make_store


@pytest.fixture(params=["mariadb", "postgres"])
def sql_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[idemq.SqlStore]:
    made = make_store(request.param, tmp_path)
    yield made
    dispose(made)


class Ledger:
    """Effects (one row per message) and two contended rows, ``A`` and ``B``."""

    def __init__(self, store: idemq.SqlStore) -> None:
        self.engine = store.engine
        self.effects, self.rows, self.bulk = unique("fx"), unique("rows"), unique("bulk")
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {self.effects} (message_id VARCHAR(64))"))
            conn.execute(sa.text(f"CREATE TABLE {self.rows} (name VARCHAR(8) PRIMARY KEY, n INT)"))
            conn.execute(sa.text(f"INSERT INTO {self.rows} VALUES ('A', 0), ('B', 0)"))
            conn.execute(sa.text(f"CREATE TABLE {self.bulk} (i INT)"))

    def counts(self) -> Counter[str]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT message_id FROM {self.effects}"))
            return Counter(r[0] for r in rows)

    def drop(self) -> None:
        with self.engine.begin() as conn:
            for table in (self.effects, self.rows, self.bulk):
                conn.execute(sa.text(f"DROP TABLE {table}"))


def test_a_deadlock_in_the_isolated_rerun_reruns_the_batch_and_loses_nothing(sql_store):
    ledger = Ledger(sql_store)
    guard = idemq.Idempotency(sql_store, consumer=unique("c"))
    messages = [
        idemq.Message(id="M1", body=b"A"),  # locks row A
        idemq.Message(id="POISON", body=b"poison"),  # fails: the batch reruns isolated
        idemq.Message(id="M2", body=b"B"),  # wants row B, which the rival holds
        idemq.Message(id="M3", body=b"-"),
    ]
    passes = Counter[str]()
    waiting_for_b = threading.Event()
    rival_done = threading.Event()

    def handler(msg: idemq.Message, tx: Any) -> str:
        passes[msg.id] += 1
        if msg.body == b"poison":
            raise RuntimeError("poison message")
        if msg.body in (b"A", b"B"):
            # The isolated pass (the second) of M2 is the one that meets the rival.
            if msg.id == "M2" and passes["POISON"] >= 1 and not rival_done.is_set():
                waiting_for_b.set()
            tx.execute(
                sa.text(f"UPDATE {ledger.rows} SET n = n + 1 WHERE name = :name"),
                {"name": msg.body.decode()},
            )
        tx.execute(sa.text(f"INSERT INTO {ledger.effects} VALUES (:m)"), {"m": msg.id})
        return msg.id

    def rival() -> None:
        with ledger.engine.connect() as conn:
            trans = conn.begin()
            conn.execute(
                sa.text(f"INSERT INTO {ledger.bulk} VALUES (:i)"), [{"i": i} for i in range(500)]
            )  # the bigger transaction: InnoDB makes the other one the victim
            conn.execute(sa.text(f"UPDATE {ledger.rows} SET n = n + 1 WHERE name = 'B'"))
            assert waiting_for_b.wait(30)
            time.sleep(0.3)  # the batch is now waiting for B while holding A
            try:
                conn.execute(sa.text(f"UPDATE {ledger.rows} SET n = n + 1 WHERE name = 'A'"))
                trans.commit()
            except sa.exc.DBAPIError:
                trans.rollback()  # PostgreSQL may pick this side instead: fine either way
            finally:
                rival_done.set()

    thread = threading.Thread(target=rival)
    thread.start()
    try:
        outcomes = guard.process_batch(messages, handler)
    finally:
        waiting_for_b.set()
        thread.join(30)
        counts = ledger.counts()
        ledger.drop()
    if sql_store.engine.dialect.name in ("mysql", "mariadb"):
        # Optimistic pass, the isolated pass the deadlock killed, and the rerun of it.
        assert passes["M1"] == 3, passes
    statuses = {o.message_id: o.status for o in outcomes}
    assert statuses == {
        "M1": idemq.Status.PROCESSED,
        "POISON": idemq.Status.FAILED,
        "M2": idemq.Status.PROCESSED,
        "M3": idemq.Status.PROCESSED,
    }
    assert counts == Counter({"M1": 1, "M2": 1, "M3": 1})  # every effect once, all committed
    for message_id in ("M1", "M2", "M3"):  # and each beside its dedup row
        record = sql_store.get(message_id, guard.consumer)
        assert record is not None
        assert record.status is idemq.RecordStatus.PROCESSED
    assert sql_store.get("POISON", guard.consumer) is None  # retryable
    again = guard.process_batch(messages[:1], handler)
    assert again[0].status is idemq.Status.DUPLICATE
