"""TLS as production runs it: PostgreSQL with ``sslmode=verify-full`` and Redis with ``rediss://``,
on real servers the tests start on free ports with a throwaway CA.

The right CA works (a guard processes a message, its effect lands once); a wrong CA, or no CA at
all, is a configuration error the same settings would hit again: ``StoreConfigurationError`` from
the library, exit 2 and one line from the CLI (an outage would be exit 4 and a retry loop).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

import idemq
from idemq.brokers.embedded import EmbeddedBroker
from idemq.errors import ConfigurationError, StoreConfigurationError
from tests.conftest import unique
from tests.integration.tls_servers import (
    Certificates,
    make_certificates,
    postgres_tls,
    redis_tls,
)

IDEMQ = str(Path(sys.executable).with_name("idemq"))

# One worker makes the certificates and starts the TLS servers once (module fixtures).
pytestmark = pytest.mark.xdist_group("tls")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def wrong_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA that did not sign the servers' certificates."""
    return make_certificates(tmp_path_factory.mktemp("other-tls"), "another CA").ca


@pytest.fixture(scope="module")
def pg_port(certs: Certificates) -> Iterator[int]:
    with postgres_tls(certs) as port:
        yield port


@pytest.fixture(scope="module")
def redis_port(certs: Certificates) -> Iterator[int]:
    with redis_tls(certs) as port:
        yield port


def pg_url(port: int, ca: Path, host: str = "127.0.0.1") -> str:
    return (
        f"postgresql+psycopg://postgres@{host}:{port}/postgres?sslmode=verify-full&sslrootcert={ca}"
    )


def rediss_url(port: int, ca: Path | None, host: str = "127.0.0.1") -> str:
    base = f"rediss://{host}:{port}/0"
    return base if ca is None else f"{base}?ssl_ca_certs={ca}"


def idemq_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [IDEMQ, *args], capture_output=True, text=True, timeout=120, check=False, env=full_env
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # no traceback
    return lines[0]


# -- PostgreSQL ----------------------------------------------------------------------------------


def test_postgres_verify_full_with_the_right_ca_processes_a_message_once(
    pg_port: int, certs: Certificates
) -> None:
    url = pg_url(pg_port, certs.ca)
    table, payments = unique("tls_dedup"), unique("tls_pay")
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {payments} (order_id TEXT, ssl BOOLEAN)")
    store = idemq.SqlStore(url, table=table)
    store.create_schema()
    guard = idemq.Idempotency(store, consumer="tls")

    def pay(tx: Any) -> dict[str, bool]:
        # The effect records whether its own connection is encrypted: the dedup transaction's.
        tx.exec_driver_sql(
            f"INSERT INTO {payments} SELECT 'o1', ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
        )
        return {"paid": True}

    first = guard.process("ORDER_TLS_1", pay)
    again = guard.process("ORDER_TLS_1", pay)
    assert first.status is idemq.Status.PROCESSED
    assert again.status is idemq.Status.DUPLICATE
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(f"SELECT order_id, ssl FROM {payments}").all()
    assert [tuple(row) for row in rows] == [("o1", True)]
    store.close()
    engine.dispose()


@pytest.mark.parametrize(
    ("refusal", "says"),
    [
        ("wrong CA", "certificate verify failed"),
        ("missing CA file", "root certificate file"),
        ("another host", "does not match host name"),
    ],
)
def test_postgres_refusing_the_certificate_is_a_configuration_error(
    pg_port: int, certs: Certificates, wrong_ca: Path, tmp_path: Path, refusal: str, says: str
) -> None:
    url = {
        "wrong CA": pg_url(pg_port, wrong_ca),
        "missing CA file": pg_url(pg_port, tmp_path / "no-such-ca.pem"),
        # The server listens there too, with a certificate for 127.0.0.1 and localhost only.
        "another host": pg_url(pg_port, certs.ca, host="127.0.0.2"),
    }[refusal]
    table = unique("tls_dedup")
    store = idemq.SqlStore(url, table=table)
    with pytest.raises(StoreConfigurationError) as raised:
        store.create_schema()
    assert isinstance(raised.value, ConfigurationError)
    assert says in str(raised.value)
    store.close()
    engine = sa.create_engine(pg_url(pg_port, certs.ca))
    with engine.connect() as conn:
        assert not sa.inspect(conn).has_table(table)  # nothing was created
    engine.dispose()


def test_postgres_with_a_wrong_ca_stops_the_cli_with_exit_2(pg_port: int, wrong_ca: Path) -> None:
    done = idemq_cli("stats", env={"IDEMQ_STORE_URL": pg_url(pg_port, wrong_ca)})
    assert done.returncode == 2, done.stderr
    assert "certificate verify failed" in one_line(done)


def test_postgres_with_the_right_ca_through_the_cli(pg_port: int, certs: Certificates) -> None:
    url = pg_url(pg_port, certs.ca)
    table = unique("tls_dedup")
    created = idemq_cli("schema", "--store", url, "--table", table, "--no-outbox")
    assert created.returncode == 0, created.stderr
    done = idemq_cli("stats", "--table", table, "--json", env={"IDEMQ_STORE_URL": url})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["total"] == 0


# -- Redis ---------------------------------------------------------------------------------------


def test_rediss_with_the_right_ca_processes_a_message_once(
    redis_port: int, certs: Certificates
) -> None:
    prefix = unique("tls")
    store = idemq.RedisStore(rediss_url(redis_port, certs.ca), prefix=prefix)
    guard = idemq.Idempotency(store, consumer="tls", mode="lease", lease_s=30)
    effects: list[str] = []

    def ship(_tx: Any) -> str:
        effects.append("shipped")
        return "shipped"

    first = guard.process("ORDER_TLS_2", ship)
    again = guard.process("ORDER_TLS_2", ship)
    assert first.status is idemq.Status.PROCESSED
    assert again.status is idemq.Status.DUPLICATE
    assert again.result == "shipped"
    assert effects == ["shipped"]
    store.close()
    # The record is on the TLS server, seen by a client of its own.
    with redis.Redis.from_url(rediss_url(redis_port, certs.ca)) as client:
        assert client.keys(f"{prefix}*")


@pytest.mark.parametrize("refusal", ["wrong CA", "no CA", "another host"])
def test_rediss_refusing_the_certificate_is_a_configuration_error(
    redis_port: int, certs: Certificates, wrong_ca: Path, refusal: str
) -> None:
    url = {
        "wrong CA": rediss_url(redis_port, wrong_ca),
        # redis-py verifies the certificate by default (ssl_cert_reqs=required) against the
        # system's CAs, which did not sign this one: refused just the same.
        "no CA": rediss_url(redis_port, None),
        "another host": rediss_url(redis_port, certs.ca, host="127.0.0.2"),
    }[refusal]
    store = idemq.RedisStore(url, prefix=unique("tls"))
    guard = idemq.Idempotency(store, consumer="tls", mode="lease", lease_s=30)
    effects: list[str] = []
    with pytest.raises(StoreConfigurationError) as raised:
        guard.process("ORDER_TLS_3", lambda _tx: effects.append("shipped"))
    assert "certificate verify failed" in str(raised.value)
    assert effects == []
    store.close()


def test_rediss_with_a_wrong_ca_stops_the_cli_with_exit_2(redis_port: int, wrong_ca: Path) -> None:
    done = idemq_cli("stats", env={"IDEMQ_STORE_URL": rediss_url(redis_port, wrong_ca)})
    assert done.returncode == 2, done.stderr
    assert "certificate verify failed" in one_line(done)


def test_rediss_with_the_right_ca_through_the_cli(redis_port: int, certs: Certificates) -> None:
    done = idemq_cli(
        "stats",
        "--prefix",
        unique("tls"),
        "--json",
        env={"IDEMQ_STORE_URL": rediss_url(redis_port, certs.ca)},
    )
    assert done.returncode == 0, done.stderr


def test_rediss_with_a_missing_ca_file_is_a_configuration_error(
    redis_port: int, tmp_path: Path
) -> None:
    # redis-py reports it as a connection error ("No such file or directory") on the first
    # command, which a worker would retry forever.
    missing = tmp_path / "no-such-ca.pem"
    with pytest.raises(ConfigurationError) as raised:
        idemq.RedisStore(rediss_url(redis_port, missing), prefix=unique("tls"))
    assert str(missing) in str(raised.value)
    done = idemq_cli("stats", env={"IDEMQ_STORE_URL": rediss_url(redis_port, missing)})
    assert done.returncode == 2, done.stderr
    assert "ssl_ca_certs" in one_line(done)


@pytest.mark.parametrize("server", ["postgres", "redis"])
def test_a_worker_whose_store_refuses_the_certificate_stops_with_exit_2(
    request: pytest.FixtureRequest, wrong_ca: Path, tmp_path: Path, server: str
) -> None:
    # Not an outage: retrying the same CA cannot succeed, so the worker does not wait for one.
    if server == "postgres":
        url = pg_url(request.getfixturevalue("pg_port"), wrong_ca)
    else:
        url = rediss_url(request.getfixturevalue("redis_port"), wrong_ca)
    (tmp_path / "fine.py").write_text("def handle(msg, tx):\n    return 1\n")
    broker = EmbeddedBroker(tmp_path / "q.db")
    broker.publish("orders", b"{}", message_id="ORDER_TLS_4")
    broker.close()
    done = subprocess.run(
        [IDEMQ, "worker", "fine:handle", "--queue", "orders"],
        env={
            **os.environ,
            "IDEMQ_STORE_URL": url,
            "IDEMQ_BROKER_URL": f"embedded:///{tmp_path / 'q.db'}",
        },
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "certificate" in one_line(done)
    broker = EmbeddedBroker(tmp_path / "q.db")
    assert broker.depth("orders") == 1  # the message waits for a worker that can store it
    broker.close()
