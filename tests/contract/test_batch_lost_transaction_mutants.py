"""A transactional batch whose later handler lost the whole transaction: the earlier messages'
rows went with it, so none of them may be answered PROCESSED (acknowledged with no effect).

SQLite rolls the whole transaction back at ``INSERT OR ROLLBACK``'s conflict, and the handler
that swallows the error goes on: a deterministic stand-in for an InnoDB deadlock caught by a
handler. Mutation testing (docs/how-we-know.md) found that no test of the fast loop failed when
the batch's final proof of its rows (``ConfirmManyIn``) was handed no rows to prove.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

import idemq
from tests.conftest import unique


@pytest.fixture
def store(tmp_path: Path) -> Iterator[idemq.SqlStore]:
    made = idemq.SqlStore(f"sqlite:///{tmp_path / 'batch.db'}", table=unique("mi"))
    made.create_schema()
    yield made
    made.drop_schema()
    made.close()


def test_a_batch_whose_last_handler_lost_the_transaction_acknowledges_nothing_unwritten(store):
    metadata = sa.MetaData()
    ledger = sa.Table(unique("ledger"), metadata, sa.Column("message_id", sa.String(128)))
    refs = sa.Table(unique("refs"), metadata, sa.Column("ref", sa.String(32), primary_key=True))
    metadata.create_all(store.engine)
    with store.engine.begin() as conn:
        conn.execute(refs.insert().values(ref="ref-1"))
    consumer = unique("c")
    guard = idemq.Idempotency(store, consumer=consumer)

    def handle(msg: idemq.Message, tx: sa.Connection) -> None:
        tx.execute(ledger.insert().values(message_id=msg.id))
        if msg.id == "B":
            try:  # noqa: SIM105 -- written as users write it
                tx.exec_driver_sql(f"INSERT OR ROLLBACK INTO {refs.name} VALUES ('ref-1')")
            except IntegrityError:
                pass

    try:
        messages = [idemq.Message(id=m, body=m.encode()) for m in ("A", "B")]
        try:
            outcomes = guard.process_batch(messages, handle)
        except idemq.StoreConflictError:
            outcomes = []
        with store.engine.connect() as conn:
            applied = sorted(conn.execute(sa.select(ledger.c.message_id)).scalars())
        for outcome in outcomes:
            if outcome.should_ack:  # acknowledged: its effect and its dedup row committed
                assert outcome.message_id in applied
                assert store.get(outcome.message_id, consumer) is not None
        for message_id in applied:  # an effect that committed has its dedup row
            assert store.get(message_id, consumer) is not None
    finally:
        metadata.drop_all(store.engine)
