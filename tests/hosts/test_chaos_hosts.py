"""``idemq chaos --hosts 3``: the chaos run spread over three network namespaces, host 1 cut off
the network while it holds messages, through the command line as a user would run it.

The verdict is the chaos run's own, read from the ledger (every effect once, nothing lost), plus
what the cut did: host 1 held messages when it went dark and the broker handed them to the other
hosts (duplicates attributed to the cut). ``tests/hosts/test_several_hosts.py`` follows one such
cut message by message; this is the operator's tool for the same attack.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from idemq.chaos.hosts import probe_namespaces
from tests.conftest import MYSQL_URL, PG_URL, REDIS_URL, require_service

pytestmark = pytest.mark.slow


def _service(url: str) -> str:
    """The tests' name of the service ``url`` reaches."""
    scheme = url.split(":", 1)[0].split("+", 1)[0]
    return {"amqp": "rabbitmq", "postgresql": "postgres", "mysql": "mysql"}.get(scheme, scheme)


AMQP = "amqp://guest:guest@127.0.0.1:5672/"


@pytest.fixture(scope="module", autouse=True)
def namespaces() -> None:
    reason = probe_namespaces()
    if reason is not None:
        # Even under CI: a runner without CAP_NET_ADMIN cannot run these tests at all.
        pytest.skip(f"network namespaces cannot be made here: {reason}")


def chaos(*args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    proc = subprocess.run(
        [sys.executable, "-m", "idemq.cli", "chaos", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    return proc, json.loads(lines[-1])


@pytest.mark.parametrize(
    ("broker", "store", "extra"),
    [
        (AMQP, PG_URL, ()),
        ("nats://127.0.0.1:4222", MYSQL_URL, ()),
        (REDIS_URL, REDIS_URL, ("--ledger", PG_URL)),  # lease mode; the ledger on PostgreSQL
    ],
    ids=["rabbitmq-postgres", "nats-mariadb", "redis-streams-redis"],
)
def test_a_host_cut_off_while_it_holds_messages(
    broker: str, store: str, extra: tuple[str, ...], tmp_path: Path
) -> None:
    for url in (broker, store, *extra[1:]):
        require_service(_service(url))
    proc, result = chaos(
        "--broker", broker,
        "--store", store,
        *extra,
        "--hosts", "3",
        "--workers", "3",
        "--messages", "200",
        "--rate", "40",  # a steady stream, so host 1 is mid-message when it is cut
        "--kill-every", "3",  # kills go on, on every host
        "--partition-rate", "0.02",
        "--cut-s", "10",
        "--dir", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, (result, proc.stderr[-3000:])
    assert result["ok"] is True
    assert result["hosts"] == 3
    assert (result["produced"], result["applied"]) == (200, 200)
    assert (result["lost"], result["double_applied"], result["unfinished"]) == (0, 0, 0)
    injected = result["injected"]
    assert isinstance(injected, dict)
    assert injected["host_cuts"] == 1
    held, retaken = result["cut_held"], result["cut_retaken"]
    assert isinstance(held, int)
    assert held >= 1, result
    # RabbitMQ drops the silent connection after two missed heartbeats and requeues what host
    # 1 held: another host runs it, and that delivery is a duplicate caused by the cut.
    assert isinstance(retaken, int)
    assert retaken >= 1, result
    causes = result["causes"]
    assert isinstance(causes, dict)
    assert causes["cut"] >= 1, result
    # Every host worked: the host logs are there, one per host.
    assert sorted(p.name for p in tmp_path.glob("host*.log")) == [
        "host1.log",
        "host2.log",
        "host3.log",
    ]


@pytest.mark.parametrize(
    ("broker", "store", "error"),
    [
        ("kafka://127.0.0.1:19092", PG_URL, "advertised address"),
        (AMQP, "sqlite:///chaos.db", "reached over the network"),
        (REDIS_URL, REDIS_URL, "pass --ledger"),
    ],
    ids=["kafka", "sqlite-store", "redis-store-sqlite-ledger"],
)
def test_what_cannot_be_spread_over_hosts_is_refused_with_exit_2(
    broker: str, store: str, error: str, tmp_path: Path
) -> None:
    proc, result = chaos(
        "--broker", broker, "--store", store, "--hosts", "3", "--dir", str(tmp_path)
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert result["ok"] is False
    assert error in str(result["error"])


def test_hosts_needs_as_many_workers(tmp_path: Path) -> None:
    require_service("mysql")
    proc, result = chaos(
        "--broker", AMQP, "--store", MYSQL_URL, "--hosts", "3", "--workers", "2"
    )  # fmt: skip
    assert proc.returncode == 2
    assert "at least as many --workers" in str(result["error"])
