"""One contract for every broker adapter, run live (subclassed once per broker).

A subclass provides the ``broker_url`` fixture (with short redelivery timers) and nothing else.
Effects go to a business table through ``tx``, so "exactly once" is checked on rows, not on
return values.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from idemq import Idempotency
from idemq.brokers import open_broker
from idemq.brokers.base import (
    DEAD_LETTER_QUEUE_HEADER,
    DEAD_LETTER_REASON_HEADER,
    Broker,
    Delivery,
)
from idemq.brokers.settlement import RetryPolicy, Verdict
from idemq.message import Message
from idemq.worker.loop import Worker
from idemq.worker.run import open_guard
from tests.conftest import PG_URL, require_service, unique
from tests.contract._proxy import CuttableProxy

SRC = str(Path(__file__).resolve().parents[2] / "src")
FAST = RetryPolicy(
    max_attempts=3,
    backoff_base_s=0.05,
    backoff_max_s=0.2,
    in_progress_delay_s=0.3,
    store_unavailable_delay_s=0.3,
)


class Business:
    """The business table the handler writes to (through ``tx``), and its row counts."""

    def __init__(self, url: str, direct_url: str | None = None) -> None:
        self.url = url  # what the worker's store uses (maybe through a cuttable proxy)
        self.table = unique("effects")
        self.engine = sa.create_engine(direct_url or url)  # what the test reads through
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {self.table} (message_id VARCHAR(200), n INT)"))
        self.fail_once: set[str] = set()
        self.always_fail: set[str] = set()
        self._lock = threading.Lock()
        self.slow_s = 0.0

    def handler(self, msg: Message, tx: Any) -> dict[str, int]:
        data = msg.json()  # the poison test sends a non-JSON body: InvalidMessageError
        tx.execute(
            sa.text(f"INSERT INTO {self.table} (message_id, n) VALUES (:m, :n)"),
            {"m": msg.id, "n": data.get("n", 0)},
        )
        if self.slow_s:
            time.sleep(self.slow_s)
        with self._lock:
            if msg.id in self.always_fail:
                raise RuntimeError("this message always fails")
            if msg.id in self.fail_once:
                self.fail_once.discard(msg.id)
                raise RuntimeError("fails once, after writing (the write must roll back)")
        return {"n": data.get("n", 0)}

    def counts(self) -> Counter[str]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT message_id FROM {self.table}")).all()
        return Counter(row[0] for row in rows)

    def drop(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE {self.table}"))
        self.engine.dispose()


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def first_delivery(stream: Iterator[Delivery | None], timeout_s: float) -> Delivery:
    """The next delivery ``stream`` hands out within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        delivery = next(stream)
        if delivery is not None:
            return delivery
    raise AssertionError(f"no delivery within {timeout_s}s")


def dead_letter_refused_comes_back(
    consumer: Broker, admin: Broker, queue: str, remove_dead_letter_destination: Callable[[], None]
) -> None:
    """The dead-letter rule of every adapter: when the dead-letter destination is removed while
    ``consumer`` runs, the copy is refused and the original comes back to ``queue`` (not
    settled away, gone from both places), as it was: same id, body and attempt."""
    stream = consumer.consume(queue, prefetch=1)
    assert next(stream) is None  # declared: the queue and its dead-letter destination
    remove_dead_letter_destination()
    admin.publish(queue, b"poison", message_id=f"P_{queue}")
    first_delivery(stream, 20).dead_letter("invalid_message: test").result(timeout=20)
    again = first_delivery(stream, 20)
    assert again.message is not None
    assert (again.message.id, again.body, again.delivery_attempt) == (f"P_{queue}", b"poison", 1)
    again.ack().result(timeout=20)
    stream.close()


class Running:
    """A worker in a thread; :meth:`stop` stops it gracefully and returns its stats."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.thread = threading.Thread(target=worker.run, daemon=True)
        self.thread.start()

    def stop(self) -> Worker:
        self.worker.stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "worker did not stop within 30 s"
        return self.worker


class BrokerContract:
    """The tests every broker adapter must pass (not collected itself: no ``Test`` prefix)."""

    @pytest.fixture(autouse=True)
    def _close_guards(self) -> Iterator[None]:
        self.guards: list[Idempotency] = []
        yield
        for guard in self.guards:
            guard.store.close()

    def guard(self, store_url: str, consumer: str) -> Idempotency:
        guard = open_guard(store_url, consumer)
        self.guards.append(guard)
        return guard

    redelivery_timeout_s: float = 30.0
    # False where the installed client cannot send a message without an id at all.
    can_publish_without_id: bool = True

    @pytest.fixture
    def queue(self) -> str:
        return unique("q")

    @pytest.fixture
    def business(self, tmp_path: Path) -> Iterator[Business]:
        biz = Business(f"sqlite:///{tmp_path / 'business.db'}")
        yield biz
        biz.drop()

    @pytest.fixture
    def publisher(self, broker_url: str, queue: str) -> Iterator[Broker]:
        broker = open_broker(broker_url)
        broker.declare(queue)
        yield broker
        broker.delete_queue(queue)
        broker.close()

    def publish_duplicate(
        self,
        publisher: Broker,
        queue: str,
        body: bytes,
        message_id: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Publish another message with an id already sent, so that it reaches consumers — a
        broker with a dedup of its own (NATS' ``Nats-Msg-Id`` window) overrides this, so that
        idemq's dedup is what is tested."""
        publisher.publish(queue, body, headers=headers, message_id=message_id)

    def worker(
        self, broker_url: str, queue: str, business: Business, *, concurrency: int = 2
    ) -> Worker:
        guard = self.guard(business.url, unique("c"))
        return Worker(
            business.handler,
            open_broker(broker_url),
            guard,
            queue,
            concurrency=concurrency,
            policy=FAST,
        )

    def read_dead_letters(
        self, broker_url: str, queue: str, expected: int
    ) -> list[tuple[bytes, dict[str, str]]]:
        return [
            (body, headers)
            for _, body, headers in self.read_dead_messages(broker_url, queue, expected)
        ]

    def read_dead_messages(
        self, broker_url: str, queue: str, expected: int
    ) -> list[tuple[str | None, bytes, dict[str, str]]]:
        """Up to ``expected`` dead letters of ``queue`` (20 s at most): id, body, headers."""
        broker = open_broker(broker_url)
        found: list[tuple[str | None, bytes, dict[str, str]]] = []
        deadline = time.monotonic() + 20
        try:
            for delivery in broker.consume(broker.dead_letter_queue(queue), prefetch=10):
                if delivery is not None:
                    message_id = delivery.message.id if delivery.message else None
                    found.append((message_id, delivery.body, delivery.headers))
                    delivery.ack()
                if len(found) >= expected or time.monotonic() > deadline:
                    break
        finally:
            broker.close()
        return found

    # -- the contract --------------------------------------------------------------------------

    def test_each_effect_once_despite_duplicates_and_retries(
        self, broker_url: str, queue: str, business: Business, publisher: Broker
    ) -> None:
        ids = [f"M{i:03d}_{queue}" for i in range(20)]
        business.fail_once.update(ids[::4])  # 5 messages fail once after writing
        running = Running(self.worker(broker_url, queue, business))
        for i, message_id in enumerate(ids):
            publisher.publish(queue, b'{"n": %d}' % i, message_id=message_id)
        for i, message_id in enumerate(ids[:5]):  # a producer retry after a lost confirm:
            # the same id and the same body (another body would be a payload mismatch)
            self.publish_duplicate(publisher, queue, b'{"n": %d}' % i, message_id)
        wait_for(lambda: set(business.counts()) == set(ids), 30, "all 20 effects")
        # The copies reached the worker and idemq's dedup answered them: without them no
        # delivery is a DUPLICATE (a failed message's retry is one only after a copy applied it).
        wait_for(
            lambda: running.worker.stats.verdicts[Verdict.DUPLICATE] >= 5,
            30,
            "the five duplicates to be delivered",
        )
        stats = running.stop().stats
        assert business.counts() == Counter({message_id: 1 for message_id in ids})
        assert stats.verdicts[Verdict.PROCESSED] == 20
        assert stats.verdicts[Verdict.HANDLER_ERROR] == 5
        assert stats.verdicts[Verdict.PAYLOAD_MISMATCH] == 0
        assert not business.fail_once  # every forced failure really was redelivered

    def test_crash_after_commit_before_ack_is_redelivered_and_absorbed(
        self, broker_url: str, queue: str, business: Business, publisher: Broker, tmp_path: Path
    ) -> None:
        consumer = unique("c")
        ids = [f"C{i:03d}_{queue}" for i in range(5)]
        for i, message_id in enumerate(ids):
            publisher.publish(queue, b'{"n": %d}' % i, message_id=message_id)
        crashed = subprocess.run(
            [
                sys.executable,
                "-c",
                CRASH_SCRIPT,
                broker_url,
                queue,
                business.url,
                business.table,
                consumer,
            ],
            env={**os.environ, "PYTHONPATH": SRC},
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert crashed.returncode == 99, crashed.stderr.decode()
        assert sum(business.counts().values()) == 1  # committed, never acked

        guard = self.guard(business.url, consumer)
        worker = Worker(business.handler, open_broker(broker_url), guard, queue, policy=FAST)
        running = Running(worker)
        wait_for(lambda: set(business.counts()) == set(ids), 30, "all effects")
        wait_for(
            lambda: worker.stats.verdicts[Verdict.DUPLICATE] >= 1,
            self.redelivery_timeout_s,
            "the crashed message to be redelivered",
        )
        running.stop()
        assert business.counts() == Counter({message_id: 1 for message_id in ids})

    def test_poison_messages_are_dead_lettered_with_reason(
        self, broker_url: str, queue: str, business: Business, publisher: Broker
    ) -> None:
        running = Running(self.worker(broker_url, queue, business))
        exploding = f"X_{queue}"
        business.always_fail.add(exploding)
        poison = 4 if self.can_publish_without_id else 3
        if self.can_publish_without_id:
            publisher.publish(queue, b'{"kind": "no-id"}')
        publisher.publish(queue, b'{"kind": "long-id"}', message_id="L" * 200)
        publisher.publish(queue, b"not json at all", message_id=f"J_{queue}")
        publisher.publish(queue, b'{"kind": "explode"}', message_id=exploding)
        good = [f"G{i}_{queue}" for i in range(3)]
        for message_id in good:
            publisher.publish(queue, b'{"n": 1}', message_id=message_id)
        wait_for(lambda: set(business.counts()) == set(good), 30, "the good messages")
        dead = self.read_dead_letters(broker_url, queue, expected=poison)
        running.stop()
        reasons = {body: headers.get(DEAD_LETTER_REASON_HEADER, "") for body, headers in dead}
        assert len(dead) == poison, reasons
        if self.can_publish_without_id:
            assert reasons[b'{"kind": "no-id"}'].startswith("invalid_message: no message id")
        assert reasons[b'{"kind": "long-id"}'].startswith("invalid_message: InvalidMessageIdError")
        assert reasons[b"not json at all"].startswith("invalid_message: InvalidMessageError")
        assert reasons[b'{"kind": "explode"}'].startswith("handler_error: gave up after 3")
        assert business.counts() == Counter({message_id: 1 for message_id in good})

    def test_store_outage_loses_nothing(
        self, broker_url: str, queue: str, publisher: Broker
    ) -> None:
        require_service("postgres")
        proxy = CuttableProxy(("127.0.0.1", 5432))
        url = sa.make_url(PG_URL).set(host="127.0.0.1", port=proxy.port)
        business = Business(url.render_as_string(hide_password=False), PG_URL)
        try:
            ids = [f"S{i:03d}_{queue}" for i in range(20)]
            business.slow_s = 0.05
            worker = self.worker(broker_url, queue, business, concurrency=2)
            running = Running(worker)
            for i, message_id in enumerate(ids):
                publisher.publish(queue, b'{"n": %d}' % i, message_id=message_id)
            wait_for(lambda: len(business.counts()) >= 3, 30, "a few effects")
            proxy.cut()
            time.sleep(1.5)
            proxy.restore()
            wait_for(lambda: set(business.counts()) == set(ids), 60, "every effect after outage")
            running.stop()
            assert business.counts() == Counter({message_id: 1 for message_id in ids})
            assert worker.stats.verdicts[Verdict.STORE_UNAVAILABLE] >= 1
        finally:
            proxy.restore()
            business.drop()
            proxy.close()

    def test_payload_mismatch_is_dead_lettered_with_its_original_headers(
        self, broker_url: str, queue: str, business: Business, publisher: Broker
    ) -> None:
        # An id reused with another body: the second message is dead-lettered with the reason,
        # keeping its own body and headers (the producer's and idemq's id), and the first
        # message's effect stays the only one.
        running = Running(self.worker(broker_url, queue, business))
        message_id = f"PM_{queue}"
        publisher.publish(queue, b'{"n": 1}', headers={"x-trace": "first"}, message_id=message_id)
        wait_for(lambda: message_id in business.counts(), 30, "the first message")
        self.publish_duplicate(
            publisher, queue, b'{"n": 2}', message_id, {"x-trace": "second", "x-tenant": "t-9"}
        )
        dead = self.read_dead_messages(broker_url, queue, expected=1)
        running.stop()
        assert len(dead) == 1, dead
        dead_id, body, headers = dead[0]
        assert body == b'{"n": 2}'
        assert headers[DEAD_LETTER_REASON_HEADER].startswith("payload_mismatch: "), headers
        assert headers[DEAD_LETTER_QUEUE_HEADER] == queue
        assert (headers["x-trace"], headers["x-tenant"]) == ("second", "t-9")
        assert dead_id == message_id  # in the header or the broker's own id field
        assert business.counts() == Counter({message_id: 1})
        with business.engine.connect() as conn:
            n = conn.execute(sa.text(f"SELECT n FROM {business.table}")).scalar_one()
        assert n == 1, "the first message's effect, not the second's"
        assert running.worker.stats.verdicts[Verdict.PAYLOAD_MISMATCH] == 1

    # How long the store stays cut in the outage-attempts test: long enough for the outage alone
    # to redeliver each message several times the policy's max_attempts.
    outage_s: float = 3.0

    def test_outage_redeliveries_are_not_attempts(
        self, broker_url: str, queue: str, publisher: Broker
    ) -> None:
        # Messages delivered while the store is cut come back again and again (every one a
        # STORE_UNAVAILABLE retry), so the broker's own delivery counter runs far past
        # max_attempts. Then one transient handler failure must not dead-letter the message —
        # only idemq's own failed runs count — while a message that always fails is still
        # dead-lettered after exactly max_attempts handler runs.
        require_service("postgres")
        proxy = CuttableProxy(("127.0.0.1", 5432))
        url = sa.make_url(PG_URL).set(host="127.0.0.1", port=proxy.port)
        business = Business(url.render_as_string(hide_password=False), PG_URL)
        try:
            worker = self.worker(broker_url, queue, business, concurrency=1)
            running = Running(worker)
            warm = f"W_{queue}"
            publisher.publish(queue, b'{"n": 0}', message_id=warm)
            wait_for(lambda: warm in business.counts(), 30, "the worker to be up")
            proxy.cut()
            cut_at = time.monotonic()
            flaky, poison = f"F_{queue}", f"P_{queue}"
            business.fail_once.add(flaky)
            business.always_fail.add(poison)
            publisher.publish(queue, b'{"n": 1}', message_id=flaky)
            publisher.publish(queue, b'{"n": 2}', message_id=poison)
            outage_retries = 4 * FAST.max_attempts
            wait_for(
                lambda: worker.stats.verdicts[Verdict.STORE_UNAVAILABLE] >= outage_retries,
                self.outage_s + 60,
                "the outage to redeliver both messages",
            )
            time.sleep(max(self.outage_s - (time.monotonic() - cut_at), 0))
            proxy.restore()
            wait_for(lambda: flaky in business.counts(), 60, "the flaky message after the outage")
            dead = self.read_dead_letters(broker_url, queue, expected=1)
            running.stop()
            assert business.counts() == Counter({warm: 1, flaky: 1})
            assert not business.fail_once, "the flaky message's one failure happened"
            assert [body for body, _ in dead] == [b'{"n": 2}'], "only the poison is dead"
            reason = dead[0][1].get(DEAD_LETTER_REASON_HEADER, "")
            assert reason.startswith(f"handler_error: gave up after {FAST.max_attempts} "), reason
            # flaky once, the poison max_attempts times: the outage counted for nothing.
            assert worker.stats.verdicts[Verdict.HANDLER_ERROR] == 1 + FAST.max_attempts
            assert worker.stats.verdicts[Verdict.STORE_UNAVAILABLE] >= outage_retries
        finally:
            proxy.restore()
            business.drop()
            proxy.close()

    def test_sigterm_finishes_in_flight_then_exits(
        self, broker_url: str, queue: str, business: Business, publisher: Broker, tmp_path: Path
    ) -> None:
        (tmp_path / "slow_handler.py").write_text(SLOW_HANDLER)
        consumer = unique("c")
        proc = subprocess.Popen(
            [sys.executable, "-c", SIGTERM_SCRIPT, broker_url, queue, business.url, consumer],
            env={
                **os.environ,
                "PYTHONPATH": f"{SRC}{os.pathsep}{tmp_path}",
                "EFFECTS_TABLE": business.table,
            },
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stderr is not None
            line = ""
            for line in proc.stderr:
                if "idemq worker ready" in line:
                    break
            assert "idemq worker ready: broker=" in line, line
            assert f"queue={queue} store=" in line
            message_id = f"T_{queue}"
            publisher.publish(queue, b'{"n": 7}', message_id=message_id)
            wait_for((tmp_path / "started").exists, 20, "the handler to start")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
        assert business.counts() == Counter({message_id: 1})
        # It was acked, not left for redelivery: a fresh worker sees nothing.
        guard = self.guard(business.url, consumer)
        worker = Worker(business.handler, open_broker(broker_url), guard, queue, policy=FAST)
        running = Running(worker)
        time.sleep(min(self.redelivery_timeout_s, 3.0))
        assert running.stop().stats.deliveries == 0


CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import sqlalchemy as sa
    from idemq.brokers import open_broker
    from idemq.brokers.settlement import Verdict
    from idemq.worker.loop import Worker
    from idemq.worker.run import open_guard

    broker_url, queue, store_url, table, consumer = sys.argv[1:6]

    def handler(msg, tx):
        tx.execute(sa.text(f"INSERT INTO {table} (message_id, n) VALUES (:m, 0)"), {"m": msg.id})

    class CrashAfterCommit(Worker):
        def handle(self, delivery):
            verdict, _ = self._verdict(delivery)
            if verdict is Verdict.PROCESSED:
                os._exit(99)  # effect committed, ack never sent: cause 3 of DESIGN.md
            return super().handle(delivery)

    guard = open_guard(store_url, consumer)
    CrashAfterCommit(handler, open_broker(broker_url), guard, queue).run()
    """
)

SLOW_HANDLER = textwrap.dedent(
    """
    import os, pathlib, time
    import sqlalchemy as sa

    def handle(msg, tx):
        tx.execute(
            sa.text(f"INSERT INTO {os.environ['EFFECTS_TABLE']} (message_id, n) VALUES (:m, 1)"),
            {"m": msg.id},
        )
        pathlib.Path(__file__).with_name("started").touch()
        time.sleep(1.5)  # SIGTERM lands here: the worker must finish, commit and ack
    """
)

SIGTERM_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    from idemq.worker.run import run_worker

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    broker_url, queue, store_url, consumer = sys.argv[1:5]
    run_worker("slow_handler:handle", broker_url=broker_url, queue=queue, store_url=store_url,
               consumer=consumer)
    """
)
