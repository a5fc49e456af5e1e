"""A chaos run's production: one thread publishes every order once, through the partitions that
make cause 1 (a lost confirm, so the producer publishes the same message id again).
"""

from __future__ import annotations

import random
import threading
import time

from idemq.brokers.publish import Publisher
from idemq.chaos.faults import ProducerBroker
from idemq.chaos.plan import RunPlan
from idemq.chaos.proxy import FaultProxy
from idemq.errors import BrokerUnavailableError

__all__ = ["Production"]


class Production:
    """The producer thread and its counts (read by the supervision while it runs)."""

    def __init__(self, plan: RunPlan, producer: ProducerBroker, proxy: FaultProxy | None) -> None:
        self.plan = plan
        self.producer = producer
        self.proxy = proxy  # None where the producer loses confirms itself
        self.produced = 0
        self.partitions = 0
        self.publish_attempts = 0
        self.produced_orders: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop publishing: a message being retried is given up, the thread ends soon after."""
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _produce(self) -> None:
        c = self.plan.config
        publisher = Publisher(self.producer, prefix="ORDER", attempts=4, retry_delay_s=0.2)
        rng = random.Random(c.seed + 2)
        started_s = time.monotonic()
        for n in range(c.messages):
            if c.rate_per_s > 0:
                self._stop.wait(max(started_s + n / c.rate_per_s - time.monotonic(), 0))
            order_id = f"order-{n:07d}"
            body = f'{{"event": "pay", "order_id": "{order_id}"}}'.encode()
            message_id = publisher.ids.next_id()
            if self.plan.caps.partition and rng.random() < c.partition_rate:
                self.partitions += 1
                if self.proxy is not None:
                    self.proxy.partition(2 * c.confirm_timeout_s)
                else:
                    self.producer.lose_next_confirm()
            while not self._stop.is_set():
                try:
                    publisher.publish(
                        self.plan.queue, body, message_id=message_id, business_id=order_id
                    )
                    break
                except BrokerUnavailableError:
                    continue  # keep the same id: the message must get through, once or more
            else:
                return
            self.produced += 1
            self.produced_orders.append(order_id)
        self.publish_attempts = sum(self.producer.attempts.values())
