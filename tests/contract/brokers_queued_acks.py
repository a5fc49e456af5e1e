"""The contract of adapters that queue their acks to a loop thread (RabbitMQ, NATS).

``Delivery.ack()`` returns before the ack left (``idemq.brokers._aioloop.AckQueue``). That must
not cost a guarantee: a worker killed with acks still queued gets those messages redelivered and
the guard applies each once; a graceful stop sends what is queued; an ack that fails is counted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from typing import Any

from idemq.brokers import open_broker
from idemq.brokers.base import Broker, Delivery
from idemq.brokers.settlement import Verdict
from idemq.message import Message
from idemq.worker.loop import Worker
from tests.conftest import unique
from tests.contract.brokers import FAST, SRC, BrokerContract, Business, Running, wait_for


def freeze_loop(broker: Any, seconds: float) -> None:
    """Make the adapter's loop thread sleep: nothing queued to it runs meanwhile."""
    broker._loop.loop.call_soon_threadsafe(time.sleep, seconds)


class QueuedAckContract(BrokerContract):
    """Subclasses also implement :meth:`break_connection`."""

    def break_connection(self, broker: Any, delivery: Delivery) -> None:
        """Make every later ack of ``delivery`` fail (its channel or connection closed)."""
        raise NotImplementedError

    def assert_nothing_redelivered(self, broker_url: str, queue: str) -> None:
        """A fresh consumer of ``queue`` gets nothing: every ack reached the broker."""
        again = open_broker(broker_url)
        try:
            redelivered = take(again, queue, 1, timeout_s=min(self.redelivery_timeout_s, 3.0))
        finally:
            again.close()
        assert redelivered == []

    def test_kill_with_acks_queued_redelivers_and_applies_each_once(
        self, broker_url: str, queue: str, business: Business, publisher: Broker
    ) -> None:
        consumer = unique("c")
        ids = [f"K{i:03d}_{queue}" for i in range(5)]
        for i, message_id in enumerate(ids):
            publisher.publish(queue, b'{"n": %d}' % i, message_id=message_id)
        args = [broker_url, queue, business.url, business.table, consumer]
        killed = subprocess.run(
            [sys.executable, "-c", KILL_SCRIPT, *args],
            env={**os.environ, "PYTHONPATH": SRC},
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert killed.returncode == -9, killed.stderr.decode()
        committed = business.counts()
        assert committed, "the killed worker committed nothing"
        assert max(committed.values()) == 1

        worker = Worker(
            business.handler, open_broker(broker_url), self.guard(business.url, consumer), queue
        )
        running = Running(worker)
        wait_for(lambda: set(business.counts()) == set(ids), 30, "every effect")
        wait_for(
            lambda: worker.stats.verdicts[Verdict.DUPLICATE] >= len(committed),
            self.redelivery_timeout_s,
            "each message whose ack was still queued to come back",
        )
        stats = running.stop().stats
        assert business.counts() == Counter({message_id: 1 for message_id in ids})
        # Every ack was queued behind the frozen loop: every committed message came back.
        assert stats.verdicts[Verdict.DUPLICATE] == len(committed)
        assert stats.verdicts[Verdict.PROCESSED] == len(ids) - len(committed)

    def test_close_sends_the_queued_acks(
        self, broker_url: str, queue: str, publisher: Broker
    ) -> None:
        ids = publish_ids(publisher, queue, "F", 3)
        broker = open_broker(broker_url)
        deliveries = take(broker, queue, len(ids))
        freeze_loop(broker, 1.0)
        acks = [delivery.ack() for delivery in deliveries]
        assert not any(ack.done() for ack in acks), "the acks waited for nothing"
        broker.close()  # waits for the loop, sends the acks, then closes
        assert [ack.exception(0) for ack in acks] == [None] * len(ids)

        self.assert_nothing_redelivered(broker_url, queue)

    def test_acks_held_for_a_backlog_go_out_once_it_runs_dry(
        self, broker_url: str, queue: str, publisher: Broker
    ) -> None:
        ids = publish_ids(publisher, queue, "B", 20)
        broker = open_broker(broker_url)
        acks, unacked = [], []
        stream = broker.consume(queue, prefetch=len(ids))
        try:
            for delivery in stream:
                if delivery is not None and len(acks) < len(ids) // 2:
                    acks.append(delivery.ack())  # more are waiting: this ack is held
                elif delivery is not None:
                    unacked.append(delivery)
                elif len(acks) + len(unacked) == len(ids):
                    break  # dry: the consumer waits for more, so the held acks must leave now
            # Not ack.result(): waiting on a held ack sends it, which would hide a lost flush.
            wait_for(lambda: all(ack.done() for ack in acks), 10, "the held acks to be sent")
            acks += [delivery.ack() for delivery in unacked]
            wait_for(lambda: all(ack.done() for ack in acks), 10, "every ack to be sent")
            assert [ack.exception(0) for ack in acks] == [None] * len(ids)
        finally:
            stream.close()  # type: ignore[attr-defined]
            broker.close()
        self.assert_nothing_redelivered(broker_url, queue)

    def test_a_failed_ack_is_counted_and_the_message_applied_once(
        self, broker_url: str, queue: str, business: Business, publisher: Broker
    ) -> None:
        consumer = unique("c")
        message_id = f"A_{queue}"
        broker = open_broker(broker_url)
        current: dict[str, Delivery] = {}

        def handler(msg: Message, tx: Any) -> object:
            result = business.handler(msg, tx)
            self.break_connection(broker, current[msg.id])  # before the commit and the ack
            return result

        class Remembering(Worker):
            def handle(self, delivery: Delivery) -> Verdict:
                assert delivery.message is not None
                current[delivery.message.id] = delivery
                return super().handle(delivery)

        guard = self.guard(business.url, consumer)
        worker = Remembering(handler, broker, guard, queue, policy=FAST)
        running = Running(worker)
        publisher.publish(queue, b'{"n": 1}', message_id=message_id)
        wait_for(lambda: worker.stats.settle_failures == 1, 30, "the failed ack to be counted")
        # The message comes back, to this worker (a restored channel) or to a fresh one.
        again = Worker(
            business.handler, open_broker(broker_url), self.guard(business.url, consumer), queue
        )
        rerun = Running(again)
        wait_for(
            lambda: (
                worker.stats.verdicts[Verdict.DUPLICATE] + again.stats.verdicts[Verdict.DUPLICATE]
                == 1
            ),
            self.redelivery_timeout_s + 10,
            "the unacked message to come back",
        )
        running.stop()
        rerun.stop()
        assert worker.stats.verdicts[Verdict.PROCESSED] == 1
        assert worker.stats.settle_failures == 1
        assert business.counts() == Counter({message_id: 1})


def publish_ids(publisher: Broker, queue: str, tag: str, n: int) -> list[str]:
    """Publish ``n`` empty messages with ids ``<tag><i>_<queue>``; return the ids."""
    ids = [f"{tag}{i}_{queue}" for i in range(n)]
    for message_id in ids:
        publisher.publish(queue, b"{}", message_id=message_id)
    return ids


def take(broker: Broker, queue: str, n: int, timeout_s: float = 20.0) -> list[Delivery]:
    """Up to ``n`` deliveries of ``queue`` (fewer when ``timeout_s`` runs out)."""
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout_s
    stream = broker.consume(queue, prefetch=n)
    try:
        for delivery in stream:
            if delivery is not None:
                got.append(delivery)
            if len(got) >= n or time.monotonic() > deadline:
                break
    finally:
        stream.close()  # type: ignore[attr-defined]
    return got


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import sqlalchemy as sa
    from idemq.brokers import open_broker
    from idemq.worker.loop import Worker
    from idemq.worker.run import open_guard

    broker_url, queue, store_url, table, consumer = sys.argv[1:6]

    def handler(msg, tx):
        tx.execute(sa.text(f"INSERT INTO {table} (message_id, n) VALUES (:m, 0)"), {"m": msg.id})

    broker = open_broker(broker_url)
    worker = Worker(handler, broker, open_guard(store_url, consumer), queue, prefetch=10)
    settle_many = worker.settler.settle_many
    frozen = []

    def acks_never_leave(judged):
        if not frozen:
            # From the first settlement on the loop thread sleeps: every ack stays queued.
            frozen.append(True)
            broker._loop.loop.call_soon_threadsafe(time.sleep, 60)
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return settle_many(judged)

    worker.settler.settle_many = acks_never_leave
    worker.run()
    """
)
