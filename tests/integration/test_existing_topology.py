"""``idemq worker`` on queues and streams the application made before idemq saw them: used as
they are, never redeclared or updated; ``--declare never`` creates nothing."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from idemq.brokers.base import DEAD_LETTER_REASON_HEADER
from tests.conftest import REDIS_URL, require_service, unique

IDEMQ = str(Path(sys.executable).with_name("idemq"))
AMQP = "amqp://guest:guest@127.0.0.1:5672/"
NATS = "nats://127.0.0.1:4222"

HANDLER = """
import sqlalchemy as sa

def handle(msg, tx):
    if msg.body == b"poison":
        raise ValueError("this order cannot be paid")
    tx.execute(sa.text("INSERT INTO effects (message_id) VALUES (:m)"), {"m": msg.id})
"""


def _start_worker(tmp_path: Path, broker: str, queue: str, *extra: str) -> subprocess.Popen[bytes]:
    (tmp_path / "shop_handlers.py").write_text(HANDLER)
    with (tmp_path / "worker.log").open("w") as log:
        return subprocess.Popen(
            [
                IDEMQ,
                "worker",
                "shop_handlers:handle",
                "--broker",
                broker,
                "--queue",
                queue,
                "--store",
                f"sqlite:///{tmp_path / 'shop.db'}",
                "--max-attempts",
                "2",
                "--concurrency",
                "2",
                *extra,
            ],
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _get(connection: Any, queue: str) -> tuple[bytes, dict[str, str]] | None:
    """One message off ``queue`` (acked), or None — also while the queue does not exist yet
    (RabbitMQ closes the channel that asked: each look gets a channel of its own)."""
    import pika  # noqa: PLC0415

    channel = connection.channel()
    try:
        method, properties, body = channel.basic_get(queue, auto_ack=True)
    except pika.exceptions.ChannelClosedByBroker:
        return None
    channel.close()
    if method is None:
        return None
    return body, {k: str(v) for k, v in (properties.headers or {}).items()}


def _effects_engine(tmp_path: Path) -> sa.Engine:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'shop.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE effects (message_id TEXT)")
    return engine


def _effects(engine: sa.Engine) -> Counter[str]:
    with engine.connect() as conn:
        return Counter(r[0] for r in conn.exec_driver_sql("SELECT message_id FROM effects"))


def _stop(worker: subprocess.Popen[bytes], log: Path) -> None:
    """SIGTERM: in-flight messages finish, exit 0, within 10 s."""
    started = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    code = worker.wait(30)
    assert code == 0, log.read_text()
    assert time.monotonic() - started < 10, "SIGTERM took more than 10 s"


def _run_until_applied(
    worker: subprocess.Popen[bytes], engine: sa.Engine, log: Path, count: int, *, timeout_s: float
) -> None:
    """Wait until ``count`` effects are in, the worker alive throughout; then a moment for late
    copies and dead letters, and SIGTERM."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(_effects(engine)) < count:
        assert worker.poll() is None, log.read_text()
        time.sleep(0.2)
    time.sleep(2.0)
    _stop(worker, log)


@pytest.mark.rabbitmq
def test_rabbitmq_classic_queue_declared_by_the_application(tmp_path: Path) -> None:
    """A classic durable queue without dead-letter arguments, declared by pika: 300 ids each
    published three times, poison and id-less messages among them → every effect once, the
    poison in ``<queue>.dlq`` with its reason, the queue as it was."""
    pika = pytest.importorskip("pika")
    require_service("rabbitmq")
    queue = unique("orders")
    connection = pika.BlockingConnection(pika.URLParameters(AMQP))
    channel = connection.channel()
    channel.queue_declare(queue, durable=True)  # classic, no x-dead-letter-exchange
    channel.confirm_delivery()
    ids = [f"ORDER_{i:04d}" for i in range(300)]
    for copy in range(3):
        for message_id in ids:
            channel.basic_publish(
                "", queue, b"{}", pika.BasicProperties(message_id=message_id, delivery_mode=2)
            )
        channel.basic_publish(
            "", queue, b"poison", pika.BasicProperties(message_id=f"POISON_{copy}")
        )
    channel.basic_publish("", queue, b"{}", pika.BasicProperties())  # no id anywhere
    engine = _effects_engine(tmp_path)
    log = tmp_path / "worker.log"
    worker = _start_worker(tmp_path, AMQP, queue)
    dead_letters: list[tuple[bytes, dict[str, str]]] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (
            len(_effects(engine)) < 300 or len(dead_letters) < 4
        ):
            assert worker.poll() is None, log.read_text()
            got = _get(connection, f"{queue}.dlq")
            if got is not None:
                dead_letters.append(got)
            else:
                time.sleep(0.2)
        time.sleep(1.0)  # a wrongly requeued copy would show up now
        _stop(worker, log)
        effects = _effects(engine)
        assert effects == Counter(dict.fromkeys(ids, 1)), "every effect exactly once"
        reasons = sorted(headers[DEAD_LETTER_REASON_HEADER] for _, headers in dead_letters)
        assert len(reasons) == 4, reasons
        assert sum("handler_error" in r for r in reasons) == 3, reasons
        assert sum("message id" in r or "invalid" in r for r in reasons) == 1, reasons
        assert sorted(body for body, _ in dead_letters) == [b"poison"] * 3 + [b"{}"]
        # The queue is the application's still: declaring it as the application does works.
        channel.queue_declare(queue, durable=True)
        assert "inequivalent" not in log.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
        channel.queue_delete(queue)
        channel.queue_delete(f"{queue}.dlq")
        connection.close()
        engine.dispose()


@pytest.mark.rabbitmq
def test_rabbitmq_declare_never_refuses_a_missing_queue_at_once(tmp_path: Path) -> None:
    require_service("rabbitmq")
    queue = unique("missing")
    _effects_engine(tmp_path).dispose()
    worker = _start_worker(tmp_path, AMQP, queue, "--declare", "never")
    code = worker.wait(30)
    text = (tmp_path / "worker.log").read_text()
    assert code == 2, text
    assert queue in text
    assert "declare=never" in text
    assert "Traceback" not in text


@pytest.mark.rabbitmq
def test_rabbitmq_dead_letter_names_the_dead_letter_queue(tmp_path: Path) -> None:
    pika = pytest.importorskip("pika")
    require_service("rabbitmq")
    queue, dead = unique("orders"), unique("poison_box")
    connection = pika.BlockingConnection(pika.URLParameters(AMQP))
    channel = connection.channel()
    channel.queue_declare(queue, durable=True)
    channel.queue_declare(dead, durable=True)
    channel.basic_publish("", queue, b"poison", pika.BasicProperties(message_id="P1"))
    engine = _effects_engine(tmp_path)
    log = tmp_path / "worker.log"
    worker = _start_worker(
        tmp_path, AMQP, queue, "--declare", "never", "--dead-letter", dead, "--max-attempts", "1"
    )
    try:
        deadline = time.monotonic() + 60
        got = None
        while got is None and time.monotonic() < deadline:
            assert worker.poll() is None, log.read_text()
            got = _get(connection, dead)
            time.sleep(0.1)
        assert got is not None, log.read_text()
        assert got[0] == b"poison"
        assert "handler_error" in got[1][DEAD_LETTER_REASON_HEADER]
        _stop(worker, log)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker):  # never made
            connection.channel().queue_declare(f"{queue}.dlq", passive=True)
        channel = connection.channel()
    finally:
        if worker.poll() is None:
            worker.kill()
        for name in (queue, dead, f"{queue}.dlq"):
            channel.queue_delete(name)
        connection.close()
        engine.dispose()


@pytest.mark.nats
def test_nats_stream_made_by_the_application_is_used_not_updated(tmp_path: Path) -> None:
    """The application's stream ``SHOP_x`` captures ``shop_x.>`` with its own settings; a worker
    on ``shop_x.paid`` consumes from it: no stream of idemq's, the settings as they were."""
    import nats  # noqa: PLC0415
    from nats.js.api import StreamConfig  # noqa: PLC0415

    require_service("nats")
    prefix = unique("shop")
    stream, subject = prefix.upper(), f"{prefix}.paid"

    async def setup() -> None:
        nc = await nats.connect(NATS)
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{prefix}.>"], max_msgs=100_000))
        for copy in range(2):
            for i in range(50):
                await js.publish(subject, b"{}", headers={"idemq-message-id": f"N{i}"})
            await js.publish(subject, b"poison", headers={"idemq-message-id": f"POISON{copy}"})
        await nc.close()

    async def streams() -> dict[str, int | None]:
        nc = await nats.connect(NATS)
        js = nc.jetstream()
        found = {info.config.name: info.config.max_msgs for info in await js.streams_info()}
        await nc.close()
        return {name: found[name] for name in found if prefix.upper() in name.upper()}

    async def teardown() -> None:
        nc = await nats.connect(NATS)
        js = nc.jetstream()
        for name in await streams():
            await js.delete_stream(name)
        await nc.close()

    asyncio.run(setup())
    engine = _effects_engine(tmp_path)
    log = tmp_path / "worker.log"
    worker = _start_worker(tmp_path, NATS, subject, "--declare", "never")
    try:
        _run_until_applied(worker, engine, log, 50, timeout_s=60)
        assert _effects(engine) == Counter({f"N{i}": 1 for i in range(50)})
        assert asyncio.run(streams()) == {stream: 100_000}, "no stream of idemq's, none changed"
    finally:
        if worker.poll() is None:
            worker.kill()
        asyncio.run(teardown())
        engine.dispose()


def _worker_exit(tmp_path: Path, broker: str, queue: str, *extra: str) -> tuple[int, str]:
    """A worker that must stop on its own (a configuration error): its code and log."""
    _effects_engine(tmp_path).dispose()
    worker = _start_worker(tmp_path, broker, queue, *extra)
    try:
        code = worker.wait(60)
    finally:
        if worker.poll() is None:
            worker.kill()
    return code, (tmp_path / "worker.log").read_text()


@pytest.mark.kafka
def test_kafka_topic_made_by_the_application_is_used_as_it_is(tmp_path: Path) -> None:
    """Three partitions made by the application's admin; the worker consumes all of them and
    dead-letters to the topic it is told, creating no topic of its own."""
    from confluent_kafka import Producer  # noqa: PLC0415
    from confluent_kafka.admin import AdminClient, NewTopic  # noqa: PLC0415

    from tests.integration.brokers.test_kafka import run_tansu  # noqa: PLC0415

    topic, dead = unique("orders"), unique("poison_box")
    with run_tansu() as bootstrap:
        admin = AdminClient({"bootstrap.servers": bootstrap})
        for future in admin.create_topics([NewTopic(topic, 3, 1), NewTopic(dead, 1, 1)]).values():
            future.result(30)
        producer = Producer({"bootstrap.servers": bootstrap})
        for i in range(30):
            headers = [("idemq-message-id", f"K{i}".encode())]
            producer.produce(topic, b"{}", partition=i % 3, headers=headers)
        producer.produce(topic, b"poison", headers=[("idemq-message-id", b"POISON")])
        producer.flush(30)
        url = f"kafka://{bootstrap}?session_timeout_ms=2000"
        engine = _effects_engine(tmp_path)
        log = tmp_path / "worker.log"
        worker = _start_worker(
            tmp_path, url, topic, "--declare", "never", "--dead-letter", dead, "--max-attempts", "1"
        )
        try:
            _run_until_applied(worker, engine, log, 30, timeout_s=90)
            assert _effects(engine) == Counter({f"K{i}": 1 for i in range(30)})
            topics = admin.list_topics(timeout=30).topics
            assert len(topics[topic].partitions) == 3, "the application's topic, unchanged"
            assert f"{topic}.dlq" not in topics, "no topic of idemq's"
            watermarks = _high_watermark(bootstrap, dead)
            assert watermarks >= 1, "the poison message went to the named dead-letter topic"
        finally:
            if worker.poll() is None:
                worker.kill()
            engine.dispose()


def _high_watermark(bootstrap: str, topic: str) -> int:
    from confluent_kafka import Consumer, TopicPartition  # noqa: PLC0415

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": unique("peek")})
    try:
        _, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)
        return int(high)
    finally:
        consumer.close()


@pytest.mark.kafka
def test_kafka_declare_never_refuses_a_missing_topic_at_once(tmp_path: Path) -> None:
    from tests.integration.brokers.test_kafka import run_tansu  # noqa: PLC0415

    topic = unique("missing")
    with run_tansu() as bootstrap:
        code, text = _worker_exit(
            tmp_path, f"kafka://{bootstrap}?session_timeout_ms=2000", topic, "--declare", "never"
        )
    assert code == 2, text
    assert topic in text
    assert "declare=never" in text
    assert "Traceback" not in text


@pytest.mark.redis
def test_redis_stream_and_group_made_by_the_application_are_used_as_they_are(
    tmp_path: Path,
) -> None:
    """The application made the stream and a group of its own name that starts at the stream's
    end ("$"): the worker joins that group, so it sees only what comes after, as the
    application decided; nothing of idemq's is created."""
    import redis  # noqa: PLC0415

    require_service("redis")
    client = redis.Redis.from_url(REDIS_URL)
    stream, group = unique("orders"), unique("billing")
    # Entries in idemq's layout (body, headers as JSON, id), as any producer of the stream.
    client.xadd(stream, {"body": b"{}", "id": b"BEFORE"})
    client.xgroup_create(stream, group, id="$")
    for i in range(20):
        client.xadd(stream, {"body": b"{}", "headers": b"{}", "id": f"R{i}".encode()})
    engine = _effects_engine(tmp_path)
    log = tmp_path / "worker.log"
    url = f"{REDIS_URL}?group={group}"
    worker = _start_worker(tmp_path, url, stream, "--declare", "never")
    try:
        _run_until_applied(worker, engine, log, 20, timeout_s=60)
        assert _effects(engine) == Counter({f"R{i}": 1 for i in range(20)})
        groups = {g["name"].decode() for g in client.xinfo_groups(stream)}
        assert groups == {group}, "no group of idemq's"
    finally:
        if worker.poll() is None:
            worker.kill()
        client.delete(stream, f"{stream}.dlq")
        client.close()
        engine.dispose()


@pytest.mark.redis
@pytest.mark.parametrize("what", ["stream", "group"])
def test_redis_declare_never_refuses_a_missing_stream_or_group_at_once(
    tmp_path: Path, what: str
) -> None:
    import redis  # noqa: PLC0415

    require_service("redis")
    client = redis.Redis.from_url(REDIS_URL)
    stream = unique("orders")
    if what == "group":
        client.xadd(stream, {"body": b"{}"})  # the stream, without idemq's group
    try:
        code, text = _worker_exit(tmp_path, REDIS_URL, stream, "--declare", "never")
        assert code == 2, text
        assert stream in text
        assert ("no consumer group" in text) is (what == "group")
        assert "Traceback" not in text
        assert client.exists(stream) == (1 if what == "group" else 0), "nothing created"
    finally:
        client.delete(stream)
        client.close()
