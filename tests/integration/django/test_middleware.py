"""The Django IdempotencyKeyMiddleware behind real servers (uvicorn on the project's ASGI app,
``manage.py runserver`` on its WSGI app) with a real HTTP client, on every database."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port, unique
from tests.integration.django.conftest import MANAGE, ROOT, payments, subprocess_env

SERVERS = ["uvicorn", "runserver"]
START_TIMEOUT_S = 60


class Server:
    def __init__(self, base: str, process: subprocess.Popen[bytes]) -> None:
        self.base = base
        self.process = process

    def post(self, path: str, body: dict[str, Any], key: str | None = None, **headers: str) -> Any:
        if key is not None:
            headers["Idempotency-Key"] = f'"{key}"'
        return httpx.post(f"{self.base}{path}", json=body, headers=headers, timeout=60)


def _start(kind: str, env: dict[str, str], log: Path) -> Server:
    port = free_port()
    if kind == "uvicorn":
        command = [
            sys.executable,
            "-m",
            "uvicorn",
            "tests.integration.django.djproject.asgi:application",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
    else:
        command = [sys.executable, str(MANAGE), "runserver", "--noreload", f"127.0.0.1:{port}"]
    out = log.open("wb")
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"{base}/count?order_id=x", timeout=2).status_code == 200:
                return Server(base, process)
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{kind} did not start: {log.read_text(errors='replace')}")
        time.sleep(0.05)


@pytest.fixture(params=SERVERS)
def server(
    request: pytest.FixtureRequest, alias: str, django_project: Any, tmp_path: Path
) -> Iterator[Server]:
    env = subprocess_env(django_project, alias, IDEMQ_DJ_HTTP=json.dumps({"consumer": unique("h")}))
    running = _start(request.param, env, tmp_path / "server.log")
    try:
        yield running
    finally:
        running.process.send_signal(signal.SIGINT)
        try:
            running.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            running.process.kill()
            running.process.wait()


def test_a_retry_replays_the_stored_response_and_pays_once(alias: str, server: Server):
    order, key = unique("o"), unique("k")
    first = server.post("/pay", {"order_id": order, "amount": 5}, key)
    again = server.post("/pay", {"order_id": order, "amount": 5}, key)
    assert first.status_code == again.status_code == 201
    assert first.json() == again.json()
    assert "Idempotent-Replayed" not in first.headers
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Content-Type"] == "application/json"
    assert payments(alias, order) == 1
    # An async view, the same rules (ASGI: its ORM calls share the dedup transaction's thread).
    async_order = unique("o")
    for _ in range(2):
        assert (
            server.post("/pay-async", {"order_id": async_order, "amount": 1}, key + "a").status_code
            == 201
        )
    assert payments(alias, async_order) == 1


def test_same_key_other_request_is_422_and_no_key_passes(alias: str, server: Server):
    order, key = unique("o"), unique("k")
    assert server.post("/pay", {"order_id": order, "amount": 5}, key).status_code == 201
    reused = server.post("/pay", {"order_id": order, "amount": 6}, key)
    assert reused.status_code == 422
    assert reused.headers["Content-Type"] == "application/problem+json"
    assert reused.json()["code"] == "idempotency-key-reused"
    bad = server.post("/pay", {"order_id": order, "amount": 6}, None, **{"Idempotency-Key": "x"})
    assert bad.status_code == 400
    assert payments(alias, order) == 1
    for _ in range(2):  # no key: not guarded
        assert server.post("/pay", {"order_id": order, "amount": 7}).status_code == 201
    assert payments(alias, order) == 3


def test_a_5xx_is_not_stored_and_its_writes_roll_back(alias: str, server: Server):
    order, key = unique("o"), unique("k")
    for _ in range(2):
        failed = server.post("/fail", {"order_id": order, "amount": 5}, key)
        assert failed.status_code == 500
        assert "Idempotent-Replayed" not in failed.headers
    assert payments(alias, order) == 0


@pytest.mark.parametrize("alias", ["pg"], indirect=True)
def test_a_retry_while_the_first_runs_is_409_at_once(alias: str, server: Server):
    """PostgreSQL: the key's in-flight lock answers a retry 409 while the first request still
    runs, without waiting for it (``wait_s=0``), and nothing of the retry is written."""
    order, key, hold_s = unique("o"), unique("k"), 4.0
    path = f"/pay?hold_ms={round(hold_s * 1000)}"
    answers: list[tuple[int, float]] = []

    def send() -> None:
        started = time.monotonic()
        status = server.post(path, {"order_id": order, "amount": 5}, key).status_code
        answers.append((status, time.monotonic() - started))

    first = threading.Thread(target=send)
    first.start()
    time.sleep(1.0)  # the first is holding its claim (if the retry claims first, they swap)
    send()
    first.join(60)
    assert sorted(status for status, _ in answers) == [201, 409], answers
    assert all(took < hold_s for status, took in answers if status == 409), answers
    assert payments(alias, order) == 1


CLIENT = """
import sys, time, pathlib, httpx
url, key, gate = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
deadline = time.monotonic() + 60
while not gate.exists() and time.monotonic() < deadline:
    time.sleep(0.002)
r = httpx.post(url, content=sys.argv[4], headers={"Idempotency-Key": f'"{key}"',
               "Content-Type": "application/json"}, timeout=60)
print(r.status_code, r.headers.get("idempotent-replayed", "-"))
"""


def test_concurrent_retries_from_processes_pay_once(alias: str, server: Server, tmp_path: Path):
    order, key = unique("o"), unique("k")
    gate = tmp_path / "go"
    body = json.dumps({"order_id": order, "amount": 5})
    clients = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT, f"{server.base}/pay?hold_ms=300", key, str(gate), body],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        for _ in range(4)
    ]
    gate.touch()
    answers = []
    for client in clients:
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0, err
        answers.append(out.split())
    firsts = [a for a in answers if a == ["201", "-"]]
    assert len(firsts) == 1, answers
    # The others were answered 409 (still running) or waited on its row lock and got a replay.
    assert all(a in (["409", "-"], ["201", "true"]) for a in answers if a not in firsts), answers
    assert payments(alias, order) == 1
    replay = httpx.post(
        f"{server.base}/pay?hold_ms=300",
        content=body,  # the same bytes: the fingerprint has the body's digest
        headers={"Idempotency-Key": f'"{key}"', "Content-Type": "application/json"},
        timeout=60,
    )
    assert replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert payments(alias, order) == 1
