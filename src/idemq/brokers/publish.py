"""``publish(...)`` / ``idemq publish``: stamp a message id, publish, retry on a timeout.

Retrying a publish whose confirm timed out is exactly how duplicates are born (cause 1 in
DESIGN.md): the first attempt may have landed. The retry is still right — giving up could lose
the message — *because* the id is stamped once, before the first attempt, and every retry
carries the same id. Then:

* brokers that dedup on the server drop the second copy (NATS ``Nats-Msg-Id`` within the
  stream's duplicate window; Kafka's idempotent producer for retries inside one producer
  session) — the adapters switch both on;
* on every other broker the consumer's guard turns the second copy into a DUPLICATE.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import zlib
from collections.abc import Callable, Mapping
from types import TracebackType

from idemq._backoff import Backoff
from idemq.brokers import open_broker
from idemq.brokers.base import Broker
from idemq.errors import BrokerUnavailableError
from idemq.guard.core import validate_business_id, validate_message_id
from idemq.ids.generator import MessageIdGenerator
from idemq.message import BUSINESS_ID_HEADER

__all__ = ["Publisher", "default_node", "publish"]

log = logging.getLogger("idemq.publish")


def default_node() -> str:
    """A node name unique per host and process (``H<crc32 of hostname>-P<pid>``).

    Two processes stamping with the same node and sequence would mint the same id for two
    different messages — the worst failure an idempotency layer can have — so the pid is in it.
    """
    host_hash = zlib.crc32(socket.gethostname().encode()) & 0xFFFFFFFF
    return f"H{host_hash:08X}-P{os.getpid()}"


_LONGEST_RETRY_DELAY_S = 5.0


class Publisher:
    """A broker connection that stamps ids and retries unconfirmed publishes with the same id."""

    def __init__(
        self,
        broker: str | Broker,
        *,
        prefix: str = "MSG",
        node: str | None = None,
        attempts: int = 3,
        retry_delay_s: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.broker = open_broker(broker) if isinstance(broker, str) else broker
        self._owns_broker = isinstance(broker, str)
        self.ids = MessageIdGenerator(prefix=prefix, node=node or default_node())
        self.attempts = max(attempts, 1)
        # Doubling from retry_delay_s: a broker that did not confirm is often busy or failing
        # over, and an immediate second publish would only add to its load.
        self.backoff = Backoff(retry_delay_s, _LONGEST_RETRY_DELAY_S)
        self._sleep = sleep

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        message_id: str | None = None,
        business_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        """Publish ``body`` to ``queue`` and return its message id (stamped if not given).

        Raises :class:`~idemq.BrokerUnavailableError` after ``attempts`` unconfirmed tries, and
        :class:`~idemq.InvalidMessageIdError` / :class:`~idemq.InvalidBusinessIdError` before
        anything is sent when a given id breaks the guard's rules: every consumer would
        dead-letter that message, so it is refused here, where its producer can still fix it.
        """
        if message_id is None:
            message_id = self.ids.next_id()
        else:
            validate_message_id(message_id)
        validate_business_id(business_id)
        all_headers = dict(headers or {})
        if business_id is not None:
            all_headers[BUSINESS_ID_HEADER] = business_id
        for attempt in range(1, self.attempts + 1):
            try:
                self.broker.publish(queue, body, headers=all_headers, message_id=message_id)
                return message_id
            except BrokerUnavailableError:
                if attempt == self.attempts:
                    raise
                # The first try may have landed: retry with the *same* id, never a new one.
                log.warning(
                    "publish of %s unconfirmed (attempt %d/%d); retrying with the same id",
                    message_id,
                    attempt,
                    self.attempts,
                )
                self._sleep(self.backoff.delay_s(attempt))
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the broker connection if this publisher opened it."""
        if self._owns_broker:
            self.broker.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def publish(
    broker_url: str,
    queue: str,
    body: bytes,
    *,
    message_id: str | None = None,
    business_id: str | None = None,
    headers: Mapping[str, str] | None = None,
    prefix: str = "MSG",
    attempts: int = 3,
) -> str:
    """Publish one message (what ``idemq publish`` runs); return its message id.

    For many messages keep a :class:`Publisher` open instead of reconnecting each time.
    """
    # Refused before connecting: an id no consumer could take is the caller's mistake (exit 2)
    # whether or not the broker is reachable.
    if message_id is not None:
        validate_message_id(message_id)
    validate_business_id(business_id)
    with Publisher(broker_url, prefix=prefix, attempts=attempts) as publisher:
        return publisher.publish(
            queue, body, message_id=message_id, business_id=business_id, headers=headers
        )
