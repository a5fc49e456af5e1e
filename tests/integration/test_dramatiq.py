"""idemq.integrations.dramatiq on Dramatiq's real RabbitMQ and Redis brokers.

Every test runs on both brokers and both guard modes: the SQL store on PostgreSQL
(transactional: the actor's row commits with the dedup row) and the Redis store (lease: the row
is written through the actor's own connection). Effects are counted as business rows in a table
without a unique constraint, so a second effect would show as a second row.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.results import ResultFailure, ResultMissing

from idemq import ConfigurationError, Idempotency, SqlStore
from tests.conftest import CI, free_port, require_service, unique
from tests.integration import dramatiq_app
from tests.integration.dramatiq_app import CONFIG_ENV, App
from tests.integration.test_redis_restart import RedisServer

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis, pytest.mark.postgres]

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 30.0

BROKERS = ["rabbitmq", "redis"]
STORES = ["sql", "redis"]


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


class Recorder(dramatiq.Middleware):
    """Every settlement and skip the worker makes, by message id; and the retries option seen."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, str]] = []
        self.retries_seen: list[int] = []

    def _add(self, event: str, message: Any) -> None:
        with self.lock:
            self.events.append((event, message.message_id))

    def count(self, event: str, message_id: str) -> int:
        with self.lock:
            return self.events.count((event, message_id))

    def before_process_message(self, broker: Any, message: Any) -> None:
        with self.lock:
            self.retries_seen.append(int(message.options.get("retries", 0)))

    def after_ack(self, broker: Any, message: Any) -> None:
        self._add("ack", message)

    def after_nack(self, broker: Any, message: Any) -> None:
        self._add("nack", message)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        self._add("skip", message)


class Running:
    """An app with an in-process ``dramatiq.Worker`` and a recorder."""

    def __init__(self, app: App, recorder: Recorder, worker: dramatiq.Worker) -> None:
        self.app = app
        self.recorder = recorder
        self.worker = worker

    def drain(self) -> None:
        """Wait until the queue is empty and the worker holds nothing (delayed ones included)."""
        self.app.broker.join(self.app.queue, timeout=int(DEADLINE_S * 1000))
        # Worker.join has no deadline: a message that keeps coming back would hang the test.
        joiner = threading.Thread(target=self.worker.join, daemon=True)
        joiner.start()
        joiner.join(DEADLINE_S)
        assert not joiner.is_alive(), "the worker still holds messages"

    def dead_lettered(self) -> int:
        broker = self.app.broker
        if isinstance(broker, RabbitmqBroker):
            return int(broker.get_queue_message_counts(self.app.queue)[2])
        namespace = self.app.config["namespace"]
        return int(self.app.redis.zcard(f"{namespace}:{self.app.queue}.XQ"))


def make_config(broker: str, store: str, **extra: Any) -> dict[str, Any]:
    require_service("postgres")
    require_service("redis")
    if broker == "rabbitmq":
        require_service("rabbitmq")
    return {
        "broker": broker,
        "store": store,
        "namespace": unique("dq"),
        "queue": unique("q"),
        "table": unique("mi"),
        "orders": unique("orders"),
        "consumer": unique("pay"),
        **extra,
    }


@pytest.fixture
def start() -> Iterator[Callable[..., Running]]:
    started: list[tuple[Running, dict[str, Any]]] = []

    def run(broker: str, store: str, **extra: Any) -> Running:
        config = make_config(broker, store, **extra)
        dramatiq_app.prepare(config)
        app = dramatiq_app.build(config)
        recorder = Recorder()
        app.broker.add_middleware(recorder)
        worker = dramatiq.Worker(app.broker, worker_threads=4, worker_timeout=100)
        worker.start()
        running = Running(app, recorder, worker)
        started.append((running, config))
        return running

    yield run
    for running, config in started:
        running.worker.stop(timeout=10_000)
        running.app.close()
        dramatiq_app.cleanup(config)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("broker", BROKERS)
def test_same_message_enqueued_twice_has_one_effect_and_one_result(
    start: Callable[..., Running], broker: str, store: str
) -> None:
    run = start(broker, store)
    order = unique("o")
    message = run.app.pay.message(order, 10)
    run.app.broker.enqueue(message)
    run.app.broker.enqueue(message)  # the producer's retry: same message id

    wait_for(lambda: run.recorder.count("ack", message.message_id) >= 2, "both copies acked")
    run.drain()
    assert run.app.rows() == {order: 1}
    assert run.app.runs(order) == 1
    # The duplicate got the stored result, and so does whoever asks for it.
    assert message.get_result(backend=run.app.results) == {"paid": order, "amount": 10}
    assert run.recorder.count("nack", message.message_id) == 0


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("broker", BROKERS)
def test_payload_mismatch_is_dead_lettered_with_the_reason(
    start: Callable[..., Running], broker: str, store: str
) -> None:
    run = start(broker, store)
    order = unique("o")
    first = run.app.pay.message(order, 10)
    run.app.broker.enqueue(first)
    wait_for(lambda: run.recorder.count("ack", first.message_id) == 1, "the first one acked")

    clash = first.copy(args=(order, 99))  # the same id reused for other arguments
    run.app.broker.enqueue(clash)
    wait_for(lambda: run.recorder.count("nack", clash.message_id) == 1, "the clash failed")

    assert run.app.rows() == {order: 1}
    assert run.app.runs(order) == 1
    wait_for(lambda: run.dead_lettered() == 1, "the clash in the dead-letter queue")

    def stored_failure() -> str | None:
        try:
            clash.get_result(backend=run.app.results)
        except ResultFailure as exc:
            return str(exc)
        except ResultMissing:
            pass
        return None

    wait_for(lambda: stored_failure() is not None, "the failure in the result backend")
    assert "payload_mismatch" in str(stored_failure())


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("broker", BROKERS)
def test_invalid_key_is_dead_lettered_and_nothing_runs(
    start: Callable[..., Running], broker: str, store: str
) -> None:
    run = start(broker, store, key="order_id")
    message = run.app.pay.send("", 10)  # the key function answers "": not a usable id

    wait_for(lambda: run.recorder.count("nack", message.message_id) == 1, "the message failed")
    assert run.app.rows() == {}
    assert run.app.runs("") == 0
    wait_for(lambda: run.dead_lettered() == 1, "the message in the dead-letter queue")


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("broker", BROKERS)
def test_an_actor_that_raises_is_retried_then_succeeds_once(
    start: Callable[..., Running], broker: str, store: str
) -> None:
    run = start(broker, store)
    order = unique("flaky")
    message = run.app.pay.send(order, 7)

    wait_for(lambda: run.recorder.count("ack", message.message_id) >= 2, "the retry acked")
    run.drain()
    assert run.app.runs(order) == 2  # failed once, then succeeded
    # Transactional: the first run's row was rolled back with its dedup row.
    assert run.app.rows() == {order: 1}
    assert message.get_result(backend=run.app.results) == {"paid": order, "amount": 7}


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("broker", BROKERS)
def test_an_actor_that_keeps_raising_is_dead_lettered_by_dramatiqs_retries(
    start: Callable[..., Running], broker: str, store: str
) -> None:
    run = start(broker, store)
    order = unique("doomed")
    message = run.app.pay.send_with_options(args=(order, 1), max_retries=1)

    wait_for(lambda: run.recorder.count("nack", message.message_id) == 1, "the message failed")
    assert run.app.runs(order) == 2  # the first try and Dramatiq's one retry
    assert run.app.rows() == {}  # each try's row rolled back (or never made, lease mode)
    wait_for(lambda: run.dead_lettered() == 1, "the message in the dead-letter queue")


@pytest.mark.parametrize("broker", BROKERS)
def test_a_message_whose_key_a_twin_holds_comes_back_without_using_retries(
    start: Callable[..., Running], broker: str
) -> None:
    """Lease mode: B (another message, same key) meets A's claim, so B comes back later.

    A then fails for good (max_retries=0): only B's return can make the effect, so B must not
    have been acked and dropped while A held the claim. Waiting did not count as a retry of B.
    """
    run = start(broker, "redis", key="order_id")
    order = unique("slowfail")
    a = run.app.pay.message_with_options(args=(order, 3), max_retries=0)
    run.app.broker.enqueue(a)
    wait_for(lambda: run.app.runs(order) == 1, "A running")
    b = run.app.pay.message(order, 3)
    run.app.broker.enqueue(b)
    wait_for(lambda: run.recorder.count("skip", b.message_id) >= 1, "B skipped (IN_PROGRESS)")

    run.app.redis.rpush(f"{run.app.config['namespace']}:go:{order}", "go")  # A fails now
    wait_for(lambda: run.recorder.count("nack", a.message_id) == 1, "A failed")
    wait_for(lambda: run.app.rows() == {order: 1}, "B's effect")
    run.drain()
    assert run.app.runs(order) == 2
    assert run.recorder.count("nack", b.message_id) == 0
    assert set(run.recorder.retries_seen) == {0}


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("broker", BROKERS)
def test_an_actor_calling_another_directly_makes_one_effect_per_message(
    start: Callable[..., Running], broker: str, store: str
) -> None:
    run = start(broker, store)
    orders = [unique("o"), unique("o")]
    message = run.app.broker.get_actor("pay_many").message(orders, 5)
    run.app.broker.enqueue(message)
    run.app.broker.enqueue(message)

    wait_for(lambda: run.recorder.count("ack", message.message_id) >= 2, "both copies acked")
    run.drain()
    assert run.app.rows() == dict.fromkeys(orders, 1)
    assert [run.app.runs(order) for order in orders] == [1, 1]
    assert message.get_result(backend=run.app.results) == 2


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("broker", BROKERS)
def test_a_duplicate_first_step_of_a_pipeline_does_not_run_the_next_step_twice(
    start: Callable[..., Running], broker: str, store: str
) -> None:
    """Dramatiq fixes the next step's message id when the pipeline is built, and appends the
    first step's result to its arguments: the duplicate's replayed result makes the same
    message again, which the guard recognises (any other result would be a payload clash)."""
    run = start(broker, store)
    first, second = unique("o"), unique("o")
    pipe = dramatiq.pipeline(
        [run.app.pay.message(first, 3), run.app.broker.get_actor("pay_after").message(second)],
        broker=run.app.broker,
    )
    pipe.run()
    run.app.broker.enqueue(pipe.messages[0])  # the first step delivered twice
    wait_for(lambda: run.app.rows() == {first: 1, second: 1}, "both steps' effects")
    next_id = pipe.messages[1].message_id
    wait_for(lambda: run.recorder.count("ack", next_id) >= 2, "the second step twice, acked")
    run.drain()
    assert run.app.rows() == {first: 1, second: 1}
    assert run.recorder.count("nack", next_id) == 0


def test_an_actor_declared_idempotent_false_is_not_guarded(start: Callable[..., Running]) -> None:
    run = start("rabbitmq", "sql")
    order = unique("o")
    message = run.app.broker.get_actor("note").message(order)
    run.app.broker.enqueue(message)
    run.app.broker.enqueue(message)
    wait_for(lambda: run.app.rows() == {order: 2}, "both copies applied: nothing guards them")
    run.drain()
    assert run.app.rows() == {order: 2}


@pytest.mark.parametrize("broker", BROKERS)
def test_a_store_outage_brings_the_message_back_until_the_store_is_up(
    start: Callable[..., Running], broker: str, tmp_path: Path
) -> None:
    if shutil.which("redis-server") is None:
        if CI:
            pytest.fail("redis-server binary missing (CI=true)")
        pytest.skip("redis-server binary missing")
    port = free_port()  # the store's Redis: nobody listens there yet
    run = start(broker, "redis", store_url=f"redis://127.0.0.1:{port}/0")
    order = unique("o")
    message = run.app.pay.send(order, 4)

    wait_for(lambda: run.recorder.count("skip", message.message_id) >= 2, "two comebacks")
    assert run.app.rows() == {}
    assert run.app.runs(order) == 0
    server = RedisServer(port, tmp_path, aof=False)
    server.start()
    try:
        wait_for(lambda: run.app.rows() == {order: 1}, "the effect, once the store is up")
        run.drain()
    finally:
        server.kill()
    assert run.app.runs(order) == 1
    assert run.recorder.count("nack", message.message_id) == 0
    assert set(run.recorder.retries_seen) == {0}  # waiting for the store is not a failure


def run_through_kills(
    config: dict[str, Any], tmp_path: Path, orders: list[str], kill_at_rows: tuple[int, ...] = ()
) -> int:
    """Send one ``pay`` per order, run worker processes until every order has its row.

    A worker that died (SIGKILL from ``crash_at``) is restarted; with ``kill_at_rows`` the test
    SIGKILLs the worker itself once that many orders have their row. Returns the kills seen.
    The last worker is stopped gracefully once the queue is empty.
    """
    dramatiq_app.prepare(config)
    app = dramatiq_app.build(config)
    env = {**os.environ, CONFIG_ENV: json.dumps(config)}
    log_path = tmp_path / "worker.log"
    pending = sorted(kill_at_rows)
    kills = 0
    proc: subprocess.Popen[bytes] | None = None

    def start_worker() -> subprocess.Popen[bytes]:
        with log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(
                [sys.executable, "-m", "tests.integration.dramatiq_app"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )

    try:
        for n, order in enumerate(orders):
            app.pay.send(order, n)
        proc = start_worker()
        deadline = time.monotonic() + 120
        while set(rows := app.rows()) != set(orders):
            assert time.monotonic() < deadline, f"lost messages: {set(orders) - set(rows)}"
            if pending and len(rows) >= pending[0]:
                pending.pop(0)
                proc.kill()  # SIGKILL: whatever the worker's threads were doing
            if proc.poll() is not None:
                proc.wait()
                assert proc.returncode == -signal.SIGKILL, log_path.read_text()
                kills += 1
                proc = start_worker()
            time.sleep(0.05)
        app.broker.join(app.queue, timeout=60_000)
        proc.send_signal(signal.SIGTERM)  # a graceful stop finishes what it holds
        assert proc.wait(timeout=60) == 0, log_path.read_text()
        proc = None
        assert app.rows() == dict.fromkeys(orders, 1)  # every effect, each once
        return kills
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        app.close()
        dramatiq_app.cleanup(config)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("broker", BROKERS)
def test_worker_killed_after_the_effect_before_the_ack_applies_each_effect_once(
    broker: str, store: str, tmp_path: Path
) -> None:
    # Lease mode keeps one worker thread: a kill landing in another thread between its effect
    # (outside the dedup store) and its `complete` is the guarantees table's at-least-once case.
    config = make_config(broker, store, crash_at=[3, 7], worker_threads=4 if store == "sql" else 1)
    orders = [unique("o") for _ in range(12)]
    assert run_through_kills(config, tmp_path, orders) == 2


@pytest.mark.parametrize("broker", BROKERS)
def test_worker_killed_mid_transaction_applies_each_effect_once(
    broker: str, tmp_path: Path
) -> None:
    """Transactional mode, kills from outside while four threads are inside their transactions
    (each holds its transaction open a little after its insert): rollback or committed + skip."""
    config = make_config(broker, "sql", worker_threads=4, work_ms=100)
    orders = [unique("o") for _ in range(20)]
    assert run_through_kills(config, tmp_path, orders, kill_at_rows=(4, 10)) == 2


def test_the_guard_must_be_a_sync_idempotency() -> None:
    from idemq.integrations.dramatiq import IdempotencyMiddleware  # noqa: PLC0415

    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(object())  # type: ignore[arg-type]
    store = SqlStore("sqlite://")
    try:
        with pytest.raises(ConfigurationError):
            IdempotencyMiddleware(Idempotency(store, consumer="c"), key="order_id")  # type: ignore[arg-type]
    finally:
        store.close()
