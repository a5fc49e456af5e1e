"""``python manage.py idemq worker``: the handler's ORM writes commit or roll back with the dedup
row, on PostgreSQL and RabbitMQ, in real worker processes."""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from idemq.brokers import open_broker
from idemq.integrations.django import DjangoStore
from tests.conftest import CI, delete_queues, require_service, terminate_pg_sessions, unique
from tests.integration.django.conftest import MANAGE, ROOT, payments, subprocess_env
from tests.integration.test_outbox_relay import receive

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
DOCS_PAGE = ROOT / "docs" / "howto" / "integrations" / "django.md"
HANDLERS = Path(__file__).with_name("shop") / "handlers.py"


@pytest.fixture
def pg(django_project: dict[str, Any]) -> str:
    """The PostgreSQL alias (skipped locally when the server is down, failed under CI)."""
    if "pg" not in django_project:
        if CI:
            pytest.fail("PostgreSQL is not reachable (CI=true)")
        pytest.skip("PostgreSQL is not reachable")
    require_service("rabbitmq")
    return "pg"


@pytest.fixture
def queue() -> Iterator[str]:
    name = unique("djworker")
    yield name
    delete_queues(AMQP_URL, name)


class Worker:
    """A ``manage.py idemq worker`` process on ``handlers.pay_or_fail`` and its log."""

    def __init__(
        self, databases: dict[str, Any], alias: str, queue: str, tmp_path: Path, **db: Any
    ) -> None:
        # ``db``: settings of this worker's database on top of the test project's.
        self.env = subprocess_env({alias: {**databases[alias], **db}}, alias)
        self.queue = queue
        self.tmp_path = tmp_path
        self.runs = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tmp_path / "worker-0.log"

    def start(self, *options: str, handler: str = "pay_or_fail") -> None:
        self.runs += 1
        self.log = self.tmp_path / f"worker-{self.runs}.log"
        with self.log.open("w") as sink:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(MANAGE),
                    "idemq",
                    "worker",
                    f"tests.integration.django.shop.handlers:{handler}",
                    "--broker",
                    AMQP_URL,
                    "--queue",
                    self.queue,
                    "--max-attempts",
                    "100",
                    *options,
                ],
                env=self.env,
                cwd=ROOT,
                stdout=sink,
                stderr=sink,
            )
        self.wait(lambda: "idemq worker ready" in self.log.read_text(), "ready")

    def wait(self, done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
        """Until ``done()``, failing if the worker exits meanwhile."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert self.proc is not None
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, f"{what}: {self.log.read_text()}"
            time.sleep(0.05)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(30)


def publish(queue: str, *messages: tuple[str, dict[str, Any]]) -> None:
    broker = open_broker(AMQP_URL)
    try:
        broker.declare(queue)
        for message_id, body in messages:
            broker.publish(queue, json.dumps(body).encode(), message_id=message_id)
    finally:
        broker.close()


def order(order_id: str, **extra: str) -> dict[str, Any]:
    return {"order_id": order_id, "amount": 7, **extra}


def dedup_record(alias: str, message_id: str, consumer: str) -> Any:
    store = DjangoStore(using=alias)
    try:
        return store.get(message_id, consumer)
    finally:
        store.close()


@pytest.fixture
def worker(django_project: dict[str, Any], pg: str, queue: str, tmp_path: Path) -> Iterator[Worker]:
    made = Worker(django_project, pg, queue, tmp_path)
    yield made
    if made.proc is not None and made.proc.poll() is None:
        made.stop(signal.SIGKILL)


def test_a_failure_after_the_orm_write_leaves_nothing_and_the_retry_pays_once(
    worker: Worker, pg: str, queue: str, tmp_path: Path
):
    o = unique("o")
    gate = tmp_path / "gate"
    worker.start()
    publish(queue, ("m-fail", order(o, fail_until=str(gate))))
    worker.wait(lambda: "handler failed" in worker.log.read_text(), "the handler's failure")
    # The row was written, then the handler raised: the ORM write and the dedup row rolled back.
    assert payments(pg, o) == 0
    assert dedup_record(pg, "m-fail", queue) is None
    gate.touch()
    worker.wait(lambda: payments(pg, o) == 1, "the retry's payment")
    publish(queue, ("m-last", order(unique("o"))))
    worker.wait(lambda: dedup_record(pg, "m-last", queue) is not None, "the last message")
    assert worker.stop() == 0
    assert payments(pg, o) == 1
    assert dedup_record(pg, "m-fail", queue).status.name == "PROCESSED"


@pytest.mark.parametrize(
    ("options", "mode"),
    [
        ((), "transactional"),
        (("--batch-size", "4"), "transactional"),
        (("--mode", "lease"), "lease"),
    ],
    ids=["one", "batched", "lease"],
)
def test_duplicates_published_twice_pay_once(
    worker: Worker, pg: str, queue: str, options: tuple[str, ...], mode: str
):
    a, b, last = unique("o"), unique("o"), unique("o")
    publish(queue, ("m-a", order(a)), ("m-b", order(b)), ("m-a", order(a)), ("m-b", order(b)))
    worker.start(*options)
    publish(queue, ("m-a", order(a)), ("m-last", order(last)))
    worker.wait(lambda: payments(pg, last) == 1, "the last message")
    assert worker.stop() == 0
    assert [payments(pg, a), payments(pg, b), payments(pg, last)] == [1, 1, 1]
    assert f"mode={mode}" in worker.log.read_text()


def test_a_worker_killed_after_the_orm_write_pays_once_after_restart(
    worker: Worker, pg: str, queue: str, tmp_path: Path
):
    o = unique("o")
    gate, started = tmp_path / "gate", tmp_path / "started"
    worker.start()
    publish(queue, ("m-kill", order(o, hang_until=str(gate), started=str(started))))
    worker.wait(started.exists, "the handler's write")
    assert worker.stop(signal.SIGKILL) == -signal.SIGKILL  # written, not committed
    assert payments(pg, o) == 0
    gate.touch()
    worker.start()  # RabbitMQ redelivers the unacknowledged message to the new worker
    worker.wait(lambda: dedup_record(pg, "m-kill", queue) is not None, "the redelivery")
    assert worker.stop() == 0
    assert payments(pg, o) == 1


@pytest.mark.parametrize("health_checks", [False, True], ids=["plain", "CONN_HEALTH_CHECKS"])
def test_a_terminated_connection_between_messages_does_not_stop_the_worker(
    django_project: dict[str, Any], pg: str, queue: str, tmp_path: Path, health_checks: bool
):
    # Persistent connections (CONN_MAX_AGE None): the worker keeps its connection between
    # messages, and the server ends it while the worker waits.
    name = unique("djworker")
    worker = Worker(
        django_project,
        pg,
        queue,
        tmp_path,
        CONN_MAX_AGE=None,
        CONN_HEALTH_CHECKS=health_checks,
        OPTIONS={"application_name": name},
    )
    first, second, third = unique("o"), unique("o"), unique("o")
    try:
        worker.start()
        publish(queue, ("m-1", order(first)))
        worker.wait(lambda: payments(pg, first) == 1, "the first message")
        assert terminate_pg_sessions(name) == 1, "the worker's connection was not found"
        publish(queue, ("m-2", order(second)), ("m-3", order(third)))
        worker.wait(lambda: payments(pg, third) == 1, "the messages after the termination")
        assert worker.stop() == 0
    finally:
        if worker.proc is not None and worker.proc.poll() is None:
            worker.stop(signal.SIGKILL)
    assert [payments(pg, first), payments(pg, second), payments(pg, third)] == [1, 1, 1]
    stopped = worker.log.read_text().splitlines()[-1]
    assert "processed=3" in stopped
    if health_checks:
        # close_old_connections() before each message makes Django check the connection
        # again before the next transaction: the dead one is replaced, no message fails on it.
        assert "store_unavailable" not in stopped, stopped
    else:  # m-2 failed on the dead connection (Django dropped it) and its retry paid
        assert "store_unavailable=1" in stopped, stopped


def test_the_relay_publishes_what_the_handler_added_to_the_outbox(
    worker: Worker, pg: str, queue: str
):
    o, last, announced = unique("o"), unique("o"), unique("announced")
    broker = open_broker(AMQP_URL)
    try:
        broker.declare(announced)
        worker.start("--relay", handler="pay_and_announce")
        body = order(o, announce_to=announced)
        publish(
            queue,
            ("m-a", body),
            ("m-a", body),
            ("m-last", order(last, announce_to=announced)),
        )
        got = receive(broker, announced, 2)
        assert worker.stop() == 0
        assert "duplicate=1" in worker.log.read_text().splitlines()[-1]
        paid = [json.loads(d.message.body)["paid"] for d in got if d.message is not None]
        assert sorted(paid) == sorted([o, last])  # the duplicate announced nothing
        assert receive(broker, announced, 1, timeout_s=1) == []
    finally:
        broker.close()
        delete_queues(AMQP_URL, announced)
    assert payments(pg, o) == 1


def test_the_docs_example_is_the_handler_these_tests_run():
    module = HANDLERS.read_text(encoding="utf-8")
    [pay] = [f for f in ast.parse(module).body if getattr(f, "name", None) == "pay"]
    source = ast.get_source_segment(module, pay)
    assert source is not None
    page = DOCS_PAGE.read_text(encoding="utf-8")
    assert source in page
    assert "from shop.models import Payment" in page
