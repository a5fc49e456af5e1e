"""``idemq worker --mode lease`` (an effect outside the store's database) and
``--expires-after S`` (a completed record older than S counts as absent), on real brokers and
stores, through the ``idemq`` script."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from idemq.brokers import open_broker
from idemq.brokers.embedded import EmbeddedBroker
from idemq.stores import open_store
from tests.conftest import (
    MYSQL_URL,
    PG_URL,
    REDIS_URL,
    delete_queues,
    redis_cleanup,
    require_service,
    unique,
)

IDEMQ = str(Path(sys.executable).with_name("idemq"))
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"

# The effect is a line appended to a file: outside any database, so no transaction can undo
# it or make it atomic with the dedup record. The line also says what the worker passed as tx.
FILE_HANDLER = """
import os
import time

def handle(msg, tx):
    # A slow effect (an HTTP call, say): this long, to outlast the lease unless it is renewed.
    time.sleep(float(os.environ.get("EFFECT_S", "0")))
    line = f"{msg.id} {'none' if tx is None else 'tx'}\\n"
    fd = os.open(os.environ["EFFECTS_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
"""


def _store_url(backend: str, tmp_path: Path) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'idemq.db'}"
    require_service({"postgres": "postgres", "mariadb": "mysql", "redis": "redis"}[backend])
    return {"postgres": PG_URL, "mariadb": MYSQL_URL, "redis": REDIS_URL}[backend]


def _broker_url(kind: str, tmp_path: Path) -> str:
    if kind == "embedded":
        return f"embedded:///{tmp_path / 'q.db'}"
    require_service("rabbitmq")
    return AMQP_URL


class Worker:
    """An ``idemq worker`` subprocess on ``FILE_HANDLER`` and what it wrote."""

    def __init__(self, tmp_path: Path, broker_url: str, queue: str, store_url: str) -> None:
        (tmp_path / "file_effects.py").write_text(FILE_HANDLER)
        self.tmp_path = tmp_path
        self.broker_url = broker_url
        self.queue = queue
        self.store_url = store_url
        self.effects = tmp_path / "effects.txt"
        self.log = tmp_path / "worker.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self, *options: str) -> list[str]:
        return [
            IDEMQ,
            "worker",
            "file_effects:handle",
            "--broker",
            self.broker_url,
            "--queue",
            self.queue,
            "--store",
            self.store_url,
            "--consumer",
            self.queue,
            *options,
        ]

    def start(self, *options: str, effect_s: float = 0.0, log_name: str = "worker.log") -> None:
        self.log = self.tmp_path / log_name
        with self.log.open("w") as sink:
            self.proc = subprocess.Popen(
                self.argv(*options),
                cwd=self.tmp_path,
                stdout=sink,
                stderr=sink,
                env=_env(EFFECTS_FILE=str(self.effects), EFFECT_S=str(effect_s)),
            )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "idemq worker ready" not in self.log.read_text():
            assert self.proc is not None
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)

    def lines(self) -> list[str]:
        return self.effects.read_text().splitlines() if self.effects.exists() else []

    def ids(self) -> list[str]:
        return [line.split()[0] for line in self.lines()]

    def wait_for(self, message_id: str, timeout_s: float = 60.0) -> None:
        """Until ``message_id``'s effect is in the file (the worker takes one message at a
        time in order, so every message published before it has been handled too)."""
        deadline = time.monotonic() + timeout_s
        while message_id not in self.ids():
            assert self.proc is not None
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, (self.lines(), self.log.read_text())
            time.sleep(0.05)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


def _env(**extra: str) -> dict[str, str]:
    import os  # noqa: PLC0415

    return {**os.environ, **extra}


@pytest.fixture
def queue(request: pytest.FixtureRequest) -> Iterator[str]:
    name = unique("cliq")
    yield name
    if "rabbitmq" in request.node.name:
        delete_queues(AMQP_URL, name)


def _publisher(broker_url: str, queue: str) -> Callable[..., None]:
    def publish(*message_ids: str) -> None:
        broker = open_broker(broker_url)
        try:
            broker.declare(queue)
            for message_id in message_ids:
                broker.publish(queue, b"{}", message_id=message_id)
        finally:
            broker.close()

    return publish


@pytest.mark.parametrize(
    ("broker_kind", "backend"),
    [
        ("embedded", "postgres"),
        ("rabbitmq", "postgres"),
        ("embedded", "mariadb"),
        ("embedded", "sqlite"),
    ],
)
def test_lease_mode_on_a_sql_store_runs_an_outside_effect_once(
    tmp_path: Path, queue: str, broker_kind: str, backend: str
):
    table = unique("idem")
    store_url = _store_url(backend, tmp_path)
    worker = Worker(tmp_path, _broker_url(broker_kind, tmp_path), queue, store_url)
    publish = _publisher(worker.broker_url, queue)
    publish("A", "B", "A", "B", "A")  # producer retries: A three times, B twice
    worker.start("--mode", "lease", "--lease-s", "5", "--table", table)
    try:
        publish("Z")  # last: once its effect is there, every duplicate has had its turn
        worker.wait_for("Z")
    finally:
        code = worker.stop()
    store = open_store(store_url, table=table)
    try:
        records = {m: store.get(m, queue) for m in ("A", "B", "Z")}
    finally:
        store.drop_schema()
        store.close()
    assert code == 0, worker.log.read_text()
    # One effect each, and the handler ran outside any transaction (tx=None).
    assert worker.lines() == ["A none", "B none", "Z none"]
    assert all(r is not None and r.status.name == "PROCESSED" for r in records.values()), records
    assert "mode=lease" in worker.log.read_text()


def test_lease_mode_renews_the_lease_of_an_effect_that_outlasts_it(tmp_path: Path, queue: str):
    """Two workers, one message delivered twice at once, a handler three times as long as the
    lease: the second worker finds the claim live each time it retries (renewed by the first)
    and answers DUPLICATE once the first completes. Without renewal it would take the expired
    claim over and run the effect a second time."""
    table = unique("idem")
    store_url = _store_url("postgres", tmp_path)
    broker_url = _broker_url("embedded", tmp_path)
    first = Worker(tmp_path, broker_url, queue, store_url)
    second = Worker(tmp_path, broker_url, queue, store_url)
    options = ("--mode", "lease", "--lease-s", "1", "--table", table)
    # Started together, as a deployment's replicas are: both create the dedup table.
    first.start(*options, effect_s=7.0, log_name="first.log")
    second.start(*options, effect_s=7.0, log_name="second.log")
    depth = EmbeddedBroker(tmp_path / "q.db")
    try:
        first.wait_ready()  # both consuming before the two copies are published
        second.wait_ready()
        _publisher(broker_url, queue)("SLOW", "SLOW")  # a producer retry: one message twice
        # While the handler runs, its claim is a lease of --lease-s (1 s), not the default 30 s:
        # the database server's clock (the lease clock) is this machine's.
        held_ms = _lease_left_ms(store_url, table, "SLOW", queue)
        assert 0 < held_ms <= 1500, held_ms
        deadline = time.monotonic() + 90
        # Done when the effect is there and no copy is left queued (nor waiting for a retry).
        while not (first.ids() and depth.depth(queue) == 0):
            for worker in (first, second):
                assert worker.proc is not None
                assert worker.proc.poll() is None, worker.log.read_text()
            assert time.monotonic() < deadline, (first.lines(), depth.depth(queue))
            time.sleep(0.1)
    finally:
        depth.close()
        codes = [first.stop(), second.stop()]
        store = open_store(store_url, table=table)
        try:
            record = store.get("SLOW", queue)
        finally:
            store.drop_schema()
            store.close()
    assert codes == [0, 0], (first.log.read_text(), second.log.read_text())
    assert first.lines() == ["SLOW none"]  # both workers append to the same file
    assert record is not None
    assert record.status.name == "PROCESSED"


def _lease_left_ms(store_url: str, table: str, message_id: str, consumer: str) -> int:
    """How long the claim of ``message_id`` is held from now, once the store has it PROCESSING."""
    store = open_store(store_url, table=table)
    try:
        deadline = time.monotonic() + 30
        while True:
            record = store.get(message_id, consumer)
            if record is not None and record.lease_until_ms is not None:
                return record.lease_until_ms - round(time.time() * 1000)
            assert time.monotonic() < deadline, record
            time.sleep(0.02)
    finally:
        store.close()


def _refusal(tmp_path: Path, store_url: str, *options: str) -> subprocess.CompletedProcess[str]:
    worker = Worker(tmp_path, f"embedded:///{tmp_path / 'q.db'}", "orders", store_url)
    return subprocess.run(
        worker.argv(*options),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=_env(EFFECTS_FILE=str(worker.effects)),
    )


def test_transactional_mode_on_a_redis_store_is_refused_in_one_line(tmp_path: Path):
    require_service("redis")
    done = _refusal(tmp_path, REDIS_URL, "--mode", "transactional")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "--mode transactional" in lines[0]
    assert "--mode lease" in lines[0]


def test_a_lease_length_without_lease_mode_is_refused_in_one_line(tmp_path: Path):
    done = _refusal(tmp_path, f"sqlite:///{tmp_path / 'idemq.db'}", "--lease-s", "10")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "--lease-s" in lines[0]
    assert "--mode lease" in lines[0]


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_a_window_that_is_not_a_positive_number_is_a_usage_error(tmp_path: Path, value: str):
    done = _refusal(tmp_path, f"sqlite:///{tmp_path / 'idemq.db'}", "--expires-after", value)
    assert done.returncode == 2, done.stderr
    assert "--expires-after" in done.stderr


def _completed_ms(store_url: str, naming: dict[str, str], consumer: str, message_id: str) -> int:
    """When the store says ``message_id`` was completed, in Unix ms (its own record)."""
    store = open_store(store_url, **naming)
    try:
        record = store.get(message_id, consumer)
    finally:
        store.close()
    assert record is not None
    assert record.processed_time is not None
    return round(record.processed_time.timestamp() * 1000)


@pytest.mark.parametrize("backend", ["sqlite", "postgres", "mariadb", "redis"])
def test_expires_after_runs_a_message_again_once_its_window_has_passed(
    tmp_path: Path, queue: str, backend: str
):
    window_s = 3.0
    store_url = _store_url(backend, tmp_path)
    redis = backend == "redis"
    naming = {"prefix": queue} if redis else {"table": unique("idem")}
    worker = Worker(tmp_path, _broker_url("embedded", tmp_path), queue, store_url)
    publish = _publisher(worker.broker_url, queue)
    publish("A", "A", "B")  # the second A arrives well within the window: a duplicate
    ((option, name),) = naming.items()
    worker.start("--expires-after", str(window_s), f"--{option}", name)
    try:
        worker.wait_for("B")
        assert worker.ids() == ["A", "B"]
        # A real wait, on the store's own record: until its completion is older than the window.
        expired_at_ms = _completed_ms(store_url, naming, queue, "A") + window_s * 1000
        deadline = time.monotonic() + 30
        while time.time() * 1000 <= expired_at_ms + 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        publish("A", "C")  # redelivered after the window: runs again
        worker.wait_for("C")
    finally:
        code = worker.stop()
        if redis:
            redis_cleanup(queue)
        else:
            store = open_store(store_url, **naming)
            store.drop_schema()
            store.close()
    assert code == 0, worker.log.read_text()
    assert worker.ids() == ["A", "B", "A", "C"]
