"""``@idempotent`` on plain functions and on Celery tasks run by a real worker on RabbitMQ."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import idemq
from idemq.integrations.django import idempotent
from tests.conftest import require_service, unique
from tests.integration.django.conftest import ROOT, pay, payments, subprocess_env

RESULT_TIMEOUT_S = 30


def test_a_plain_function_runs_once_per_key(alias: str):
    calls: list[str] = []

    @idempotent(consumer=unique("refund"), key="order_id", using=alias)
    def refund(order_id: str, amount: int, tx: Any = None) -> dict[str, Any]:
        assert tx is not None
        assert tx.in_atomic_block
        calls.append(order_id)
        pay(alias, order_id, -amount)
        return {"refunded": order_id}

    order = unique("o")
    assert refund(order, 5) == {"refunded": order}
    assert refund(order_id=order, amount=5) == {"refunded": order}  # replayed
    assert calls == [order]
    assert payments(alias, order) == 1
    with pytest.raises(idemq.PayloadMismatchError):
        refund(order, 6)


def test_a_failing_body_leaves_nothing_and_runs_again(alias: str):
    fail = [True]

    @idempotent(consumer=unique("ship"), key=lambda order_id: f"ship-{order_id}", using=alias)
    def ship(order_id: str) -> str:
        pay(alias, order_id)
        if fail[0]:
            fail[0] = False
            raise RuntimeError("carrier down")
        return "shipped"

    order = unique("o")
    with pytest.raises(RuntimeError):
        ship(order)
    assert payments(alias, order) == 0
    assert ship(order) == ship(order) == "shipped"
    assert payments(alias, order) == 1


def test_without_a_key_outside_a_celery_task_is_refused(django_project: Any):
    @idempotent(consumer=unique("c"))
    def job() -> None:
        raise AssertionError("must not run")

    with pytest.raises(idemq.InvalidMessageIdError):
        job()


def test_celery_worker_on_rabbitmq_runs_each_task_once(django_project: Any, tmp_path: Path):
    """A real worker process on RabbitMQ, the project's SQLite file as its database."""
    require_service("rabbitmq")
    from tests.integration.django.shop import tasks  # noqa: PLC0415

    queue = unique("djq")
    tasks.app.conf.task_default_queue = queue
    env = subprocess_env(django_project, "sqlite", IDEMQ_DJ_QUEUE=queue)
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.integration.django.djproject.celery_app",
            "worker",
            "--pool=solo",
            "--loglevel=INFO",
            "-Q",
            queue,
            "-n",  # a node name of its own: two workers named alike share a pidbox queue,
            f"{queue}@%h",  # which RabbitMQ grants one of them alone (RESOURCE_LOCKED)
        ],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    order = unique("o")
    task_id = unique("task")
    try:
        first = tasks.pay.delay(order, 10).get(timeout=RESULT_TIMEOUT_S)
        # Another task id, the same order: what a producer's retry after a timeout sends.
        second = tasks.pay.delay(order_id=order, amount=10).get(timeout=RESULT_TIMEOUT_S)
        # The same task id twice (a redelivery): keyed by the task id by default.
        a = tasks.ship.apply_async((f"{order}-s",), task_id=task_id).get(timeout=RESULT_TIMEOUT_S)
        b = tasks.ship.apply_async((f"{order}-s",), task_id=task_id).get(timeout=RESULT_TIMEOUT_S)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        log.close()
        with tasks.app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
    assert first == second
    assert first["paid"] == order
    assert a == b == f"shipped {order}-s"
    assert payments("sqlite", order) == 1
    assert payments("sqlite", f"{order}-s") == 1


def test_a_key_another_caller_holds_raises_a_conflict_outside_celery(alias: str):
    """Lease mode: while one call holds the key, another gets StoreConflictError (outside a
    Celery task there is no retry to schedule), never a result it did not produce."""
    seen: list[Exception] = []

    @idempotent(
        consumer=unique("job"), key="order_id", using=alias, mode="lease", check_payload=False
    )
    def job(order_id: str, nested: bool = False) -> str:
        if not nested:
            try:
                job(order_id, nested=True)
            except idemq.StoreConflictError as exc:
                seen.append(exc)
        return "done"

    try:
        assert job(unique("o")) == "done"
        assert len(seen) == 1
    finally:
        job.guard().store.close()  # type: ignore[attr-defined]


def test_celery_twin_in_progress_is_retried_until_the_holder_is_done(
    django_project: Any, tmp_path: Path
):
    """Two tasks for one order run at once (a threads pool): the second finds the first's
    lease, is retried, and gets the first one's result; one payment."""
    require_service("rabbitmq")
    from tests.integration.django.shop import tasks  # noqa: PLC0415

    queue = unique("djq")
    tasks.app.conf.task_default_queue = queue
    env = subprocess_env(django_project, "sqlite", IDEMQ_DJ_QUEUE=queue)
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.integration.django.djproject.celery_app",
                "worker",
                "--pool=threads",
                "--concurrency=2",
                "--loglevel=INFO",
                "-Q",
                queue,
                "-n",  # see above: a node name of its own
                f"{queue}@%h",
            ],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    order = unique("o")
    started, gate = tmp_path / "started", tmp_path / "gate"
    try:
        first = tasks.hold.delay(order, str(started), str(gate))
        _wait_for(started.exists, log_path)
        second = tasks.hold.delay(order, str(started), str(gate))
        _wait_for(lambda: "retry" in log_path.read_text(errors="replace").lower(), log_path)
        gate.touch()
        assert first.get(timeout=RESULT_TIMEOUT_S) == {"held": order}
        assert second.get(timeout=RESULT_TIMEOUT_S) == {"held": order}
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        with tasks.app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
    assert payments("sqlite", order) == 1


def _wait_for(condition: Any, log_path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, log_path.read_text(errors="replace")
        time.sleep(0.02)
