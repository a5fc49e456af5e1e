"""``mqtt://host:1883``: MQTT v5, QoS 1, persistent sessions (paho-mqtt, synchronous).

MQTT has no nack, no delivery counter and no dead-letter; what it has is a persistent session:
QoS 1 messages not PUBACKed are resent (DUP) when the same client id reconnects, and messages
published while it is away are queued for it. So:

* A queue is a topic; its consumer is the client id ``idemq-<topic>`` (``?client_id=``) with
  ``clean_start=False`` and a session expiry, and manual acks: PUBACK is sent only on settle.
  :meth:`MqttBroker.declare` creates that session and subscription, so nothing published
  before the first worker starts is dropped. One consumer per client id (MQTT kicks the older).
* Headers are MQTT v5 user properties (``idemq-message-id`` …).
* Retry = publish a copy with ``idemq-not-before-ms`` and ``idemq-delivery-attempt`` (+ 1 after a
  failed handler run only; an outage or a busy lease keeps the number), then PUBACK the
  original; MQTT's DUP flag is not an attempt either. Copies not yet due are held unacked by
  the consumer (a crash → resent).
* Dead letter = publish to ``<topic>.dlq`` (QoS 1, wait for PUBACK), then PUBACK the original.
"""

from __future__ import annotations

import heapq
import queue as queue_module
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import ClassVar
from urllib.parse import parse_qs, urlsplit

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from idemq._clock import Clock, system_clock_ms
from idemq.brokers.base import Delivery, Received, Traits, outgoing_headers
from idemq.errors import BrokerUnavailableError, ConfigurationError

__all__ = ["MqttBroker"]

SESSION_EXPIRY_S = 7 * 24 * 3600


def _properties(packet_type: int) -> Properties:
    return Properties(packet_type)  # type: ignore[no-untyped-call]  # paho leaves it untyped


class MqttBroker:
    """A publishing client, plus one persistent-session consuming client per consumed topic."""

    # Nothing to declare (the session is the subscription); unacked messages return on reconnect.
    TRAITS: ClassVar[Traits] = Traits()

    def __init__(
        self,
        host: str,
        port: int = 1883,
        *,
        client_id: str | None = None,
        timeout_s: float = 10.0,
        clock_ms: Clock = system_clock_ms,
    ) -> None:
        self.host = host
        self.port = port
        self.client_id = client_id
        self.timeout_s = timeout_s
        self._clock_ms = clock_ms
        self._publisher = self._connect(None, clean=True)
        self._consumers: list[paho.Client] = []

    @classmethod
    def from_url(cls, url: str) -> MqttBroker:
        """``mqtt://host:1883?client_id=NAME``."""
        parts = urlsplit(url)
        if not parts.hostname:
            raise ConfigurationError(f"MQTT URL needs a host: {url!r}")
        query = {key: values[0] for key, values in parse_qs(parts.query).items()}
        return cls(parts.hostname, parts.port or 1883, client_id=query.get("client_id"))

    def dead_letter_queue(self, queue: str) -> str:
        """The topic ``<topic>.dlq`` (consumed by client id ``idemq-<topic>.dlq``)."""
        return f"{queue}.dlq"

    def _session_id(self, topic: str) -> str:
        if self.client_id and not topic.endswith(".dlq"):
            return self.client_id
        return f"idemq-{topic}"

    def _connect(
        self,
        client_id: str | None,
        *,
        clean: bool,
        on_message: Callable[[paho.MQTTMessage], None] | None = None,
        receive_maximum: int = 20,
    ) -> paho.Client:
        client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or "",
            protocol=paho.MQTTv5,
            manual_ack=on_message is not None,
        )
        connected = threading.Event()
        client.on_connect = lambda *_args: connected.set()
        if on_message is not None:
            client.on_message = lambda _client, _userdata, message: on_message(message)
        properties = _properties(PacketTypes.CONNECT)
        properties.SessionExpiryInterval = 0 if clean else SESSION_EXPIRY_S
        properties.ReceiveMaximum = max(receive_maximum, 1)
        try:
            client.connect(self.host, self.port, clean_start=clean, properties=properties)
        except OSError as exc:
            raise BrokerUnavailableError(f"MQTT: cannot connect: {exc}") from exc
        client.loop_start()
        if not connected.wait(self.timeout_s):
            client.loop_stop()
            raise BrokerUnavailableError(f"MQTT: no CONNACK within {self.timeout_s}s")
        return client

    def _subscribe(self, client: paho.Client, topic: str) -> None:
        done = threading.Event()
        client.on_subscribe = lambda *_args: done.set()
        client.subscribe(topic, qos=1)
        if not done.wait(self.timeout_s):
            raise BrokerUnavailableError(f"MQTT: no SUBACK for {topic!r}")

    def declare(self, queue: str) -> None:
        """Create the persistent sessions (and subscriptions) of the topic and its DLQ."""
        for topic in (queue, self.dead_letter_queue(queue)):
            client = self._connect(self._session_id(topic), clean=False)
            try:
                self._subscribe(client, topic)
            finally:
                client.disconnect()
                client.loop_stop()

    def delete_queue(self, queue: str) -> None:
        """End both sessions (queued messages are dropped with them)."""
        for topic in (queue, self.dead_letter_queue(queue)):
            client = self._connect(self._session_id(topic), clean=True)
            client.disconnect()
            client.loop_stop()

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
    ) -> None:
        """Publish at QoS 1 and wait for the PUBACK."""
        all_headers = outgoing_headers(headers, message_id)
        self.publish_with(self._publisher, queue, body, all_headers)

    def publish_with(
        self, client: paho.Client, topic: str, body: bytes, headers: Mapping[str, str]
    ) -> None:
        """QoS 1 publish of ``body`` with ``headers`` as user properties, confirmed."""
        properties = _properties(PacketTypes.PUBLISH)
        if headers:
            properties.UserProperty = list(headers.items())
        info = client.publish(topic, body, qos=1, properties=properties)
        try:
            info.wait_for_publish(self.timeout_s)
        except (RuntimeError, ValueError) as exc:
            raise BrokerUnavailableError(f"MQTT: publish failed: {exc}") from exc
        if not info.is_published():
            raise BrokerUnavailableError(f"MQTT: no PUBACK within {self.timeout_s}s")

    def consume(self, queue: str, *, prefetch: int = 1) -> Iterator[Delivery | None]:
        """Join the topic's persistent session; unacked messages of a dead consumer come first."""
        inbox: queue_module.Queue[paho.MQTTMessage] = queue_module.Queue()
        client = self._connect(
            self._session_id(queue), clean=False, on_message=inbox.put, receive_maximum=prefetch
        )
        self._consumers.append(client)
        self._subscribe(client, queue)
        held: list[tuple[int, int, MqttDelivery]] = []
        tiebreak = 0
        while True:
            if held and held[0][0] <= self._clock_ms():
                yield heapq.heappop(held)[2]
                continue
            try:
                message = inbox.get(timeout=0.2)
            except queue_module.Empty:
                yield None
                continue
            delivery = self._delivery(client, queue, message)
            if delivery.not_before_ms > self._clock_ms():
                tiebreak += 1
                heapq.heappush(held, (delivery.not_before_ms, tiebreak, delivery))
                continue
            yield delivery

    def _delivery(self, client: paho.Client, queue: str, message: paho.MQTTMessage) -> MqttDelivery:
        pairs: list[tuple[str, str]] = getattr(message.properties, "UserProperty", None) or []
        received = Received.build(queue, bytes(message.payload), dict(pairs))
        return MqttDelivery(self, received, client=client, mid=message.mid)

    def close(self) -> None:
        """Disconnect every client; unacked QoS 1 messages stay in their sessions."""
        for client in [*self._consumers, self._publisher]:
            client.disconnect()
            client.loop_stop()
        self._consumers.clear()

    def now_ms(self) -> int:
        """The broker's clock (injected in tests)."""
        return self._clock_ms()


class MqttDelivery(Delivery):
    """A QoS 1 message whose PUBACK is held until settlement."""

    def __init__(
        self,
        broker: MqttBroker,
        received: Received,
        *,
        client: paho.Client,
        mid: int,
    ) -> None:
        super().__init__(received)
        self._broker = broker
        self._client = client
        self._mid = mid

    def _puback(self) -> None:
        result = self._client.ack(self._mid, 1)
        if result != paho.MQTT_ERR_SUCCESS:
            raise BrokerUnavailableError(f"MQTT: PUBACK failed: {paho.error_string(result)}")

    def _ack(self) -> None:
        self._puback()

    def _retry(self, delay_s: float, counted: bool) -> None:
        headers = self.retry_headers(
            counted=counted, not_before_ms=self._broker.now_ms() + int(delay_s * 1000)
        )
        # Copy first, then PUBACK: a crash in between leaves two copies, never none.
        self._broker.publish_with(self._broker._publisher, self.queue, self.body, headers)
        self._puback()

    def _copy_to_dead_letter(self, headers: dict[str, str]) -> None:
        dlq = self._broker.dead_letter_queue(self.queue)
        self._broker.publish_with(self._broker._publisher, dlq, self.body, headers)
