"""Two settlement rows through a real worker on RabbitMQ, lease mode on PostgreSQL (issue 24).

``decide``/``classify`` say what IN_PROGRESS and a lost lease mean; these tests check that the
worker and the broker really do it: an IN_PROGRESS delivery is requeued (never acked, never
dead-lettered) and applied once its twin gave up; a handler whose lease was taken over is not
acked as a success, and the redelivery finds the new owner's result (DUPLICATE), so the message
is processed by the new owner only. Payload mismatch and dead letters keeping their headers are
in the broker contract (every broker).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from idemq import Idempotency, SqlStore
from idemq.brokers import open_broker
from idemq.brokers.base import Broker
from idemq.brokers.settlement import RetryPolicy, Verdict
from idemq.message import Message
from idemq.worker.loop import Worker
from tests.conftest import PG_URL, require_service, unique
from tests.contract.brokers import Running, wait_for

pytestmark = pytest.mark.rabbitmq

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
# Short delays; one attempt only, so a wrongly counted in-progress retry would dead-letter.
POLICY = RetryPolicy(max_attempts=1, in_progress_delay_s=0.3, store_unavailable_delay_s=0.3)


class Effects:
    """A business table on PostgreSQL, written by whoever ran the handler (lease mode: the
    handler's own connection)."""

    def __init__(self) -> None:
        self.table = unique("effects")
        self.engine = sa.create_engine(PG_URL)
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {self.table} (message_id TEXT, who TEXT)"))

    def write(self, message_id: str, who: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(f"INSERT INTO {self.table} VALUES (:m, :w)"), {"m": message_id, "w": who}
            )

    def rows(self) -> Counter[tuple[str, str]]:
        with self.engine.connect() as conn:
            return Counter(
                (r[0], r[1]) for r in conn.execute(sa.text(f"SELECT * FROM {self.table}"))
            )

    def drop(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE {self.table}"))
        self.engine.dispose()


@pytest.fixture
def effects() -> Iterator[Effects]:
    require_service("postgres")
    found = Effects()
    yield found
    found.drop()


@pytest.fixture
def store() -> Iterator[SqlStore]:
    require_service("postgres")
    sql_store = SqlStore(PG_URL, table=unique("idemq"))
    sql_store.create_schema()
    yield sql_store
    sql_store.drop_schema()
    sql_store.close()


@pytest.fixture
def queue() -> Iterator[tuple[Broker, str]]:
    require_service("rabbitmq")
    name = unique("q")
    publisher = open_broker(AMQP_URL)
    publisher.declare(name)
    yield publisher, name
    publisher.delete_queue(name)
    publisher.close()


def _dead_letters(broker: Broker, queue: str, wait_s: float) -> int:
    """How many dead letters ``queue`` has, reading for ``wait_s`` (and acking them)."""
    found = 0
    deadline = time.monotonic() + wait_s
    for delivery in broker.consume(broker.dead_letter_queue(queue), prefetch=10):
        if delivery is not None:
            found += 1
            delivery.ack()
        if time.monotonic() > deadline:
            break
    return found


def test_in_progress_is_requeued_and_applied_once_its_twin_gives_up(
    effects: Effects, store: SqlStore, queue: tuple[Broker, str]
) -> None:
    publisher, name = queue
    consumer = unique("c")
    message_id = f"IP_{name}"
    # The twin: another process's guard holding the claim (a live lease) while it runs.
    twin_started, twin_fails = threading.Event(), threading.Event()

    def twin_handler(_tx: Any) -> None:
        twin_started.set()
        twin_fails.wait(30)
        raise RuntimeError("the twin gives up (its effect rolled back, its claim released)")

    twin = Idempotency(store, consumer=consumer, mode="lease", lease_s=30)
    errors: list[BaseException] = []

    def run_twin() -> None:
        try:
            twin.process(message_id, twin_handler, payload=b"{}")
        except RuntimeError as exc:
            errors.append(exc)

    twin_thread = threading.Thread(target=run_twin, daemon=True)
    twin_thread.start()
    assert twin_started.wait(10)

    def handler(msg: Message, _tx: Any) -> None:
        effects.write(msg.id, "worker")

    guard = Idempotency(store, consumer=consumer, mode="lease")
    worker = Worker(handler, open_broker(AMQP_URL), guard, name, policy=POLICY)
    running = Running(worker)
    publisher.publish(name, b"{}", message_id=message_id)
    # Requeued and delivered again, more than max_attempts times, while the twin holds it.
    wait_for(
        lambda: worker.stats.verdicts[Verdict.IN_PROGRESS] >= 3, 30, "in-progress redeliveries"
    )
    assert effects.rows() == Counter(), "nothing applied while the twin holds the claim"
    twin_fails.set()
    twin_thread.join(10)
    assert len(errors) == 1
    wait_for(lambda: bool(effects.rows()), 30, "the message applied after the twin gave up")
    dead = _dead_letters(publisher, name, wait_s=1.0)
    running.stop()
    assert effects.rows() == Counter({(message_id, "worker"): 1})
    assert worker.stats.verdicts[Verdict.PROCESSED] == 1
    assert worker.stats.verdicts[Verdict.HANDLER_ERROR] == 0
    assert dead == 0, "an in-progress message is never dead-lettered"


def test_a_lost_lease_is_not_acked_and_only_the_new_owner_processes_it(
    effects: Effects, store: SqlStore, queue: tuple[Broker, str]
) -> None:
    publisher, name = queue
    consumer = unique("c")
    message_id = f"LL_{name}"
    started, resume = threading.Event(), threading.Event()
    runs: Counter[str] = Counter()

    def slow_handler(msg: Message, _tx: Any) -> str:
        runs["worker"] += 1
        started.set()
        resume.wait(30)  # outlives its 1 s lease, not renewed: another owner takes over
        return "worker"

    guard = Idempotency(store, consumer=consumer, mode="lease", lease_s=1.0, renew=False)
    worker = Worker(slow_handler, open_broker(AMQP_URL), guard, name, policy=POLICY)
    running = Running(worker)
    publisher.publish(name, b"{}", message_id=message_id)
    assert started.wait(20)
    time.sleep(2.0)  # the worker's lease (1 s) has run out, by every clock involved

    def rival_handler(_tx: Any) -> str:
        runs["rival"] += 1
        effects.write(message_id, "rival")
        return "rival"

    rival = Idempotency(store, consumer=consumer, mode="lease")
    taken = rival.process(message_id, rival_handler, payload=b"{}")
    assert taken.status.name == "PROCESSED"
    resume.set()  # the stale owner finishes: its complete must be refused
    wait_for(
        lambda: worker.stats.verdicts[Verdict.DUPLICATE] == 1,
        30,
        "the stale owner's delivery to come back and meet the new owner's result",
    )
    running.stop()
    assert worker.stats.verdicts[Verdict.PROCESSED] == 0, "a lost lease is no success"
    assert worker.stats.verdicts[Verdict.IN_PROGRESS] == 1
    assert runs == Counter({"worker": 1, "rival": 1}), "the redelivery ran no handler again"
    assert effects.rows() == Counter({(message_id, "rival"): 1})
    record = store.get(message_id, consumer)
    assert record is not None
    assert "rival" in (record.result or "")
    # Acked on the DUPLICATE: the queue is empty now.
    again = Worker(slow_handler, open_broker(AMQP_URL), guard, name, policy=POLICY)
    idle = Running(again)
    time.sleep(1.5)
    assert idle.stop().stats.deliveries == 0
