"""Shared fixtures: real services, found by port.

A test that needs a service skips when the service is unreachable on a developer's machine, and
**fails** when ``CI=true`` — a green CI run must never hide a service that did not start.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.redis_cluster import RedisCluster

CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

SERVICES: dict[str, tuple[str, int]] = {
    "postgres": ("127.0.0.1", 5432),
    "mysql": ("127.0.0.1", 3306),
    "redis": ("127.0.0.1", 6379),
    "rabbitmq": ("127.0.0.1", 5672),
    "mqtt": ("127.0.0.1", 1883),
    "nats": ("127.0.0.1", 4222),
}

PG_URL = os.environ.get("IDEMQ_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("IDEMQ_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
REDIS_URL = os.environ.get("IDEMQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it; released at once)."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port: int = sock.getsockname()[1]
        return port


def require_service(name: str) -> None:
    """Skip (locally) or fail (under CI=true) when ``name`` is not reachable."""
    host, port = SERVICES[name]
    if port_open(host, port):
        return
    message = f"{name} is not reachable at {host}:{port}"
    if CI:
        pytest.fail(f"{message} (CI=true: a missing service is a failure, not a skip)")
    pytest.skip(message)


def unique(prefix: str = "t") -> str:
    """A short unique name for tables/consumers so concurrent test runs never collide."""
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'idemq.db'}"


@pytest.fixture
def pg_url() -> str:
    require_service("postgres")
    return PG_URL


@pytest.fixture
def mysql_url() -> str:
    require_service("mysql")
    return MYSQL_URL


@pytest.fixture
def redis_url() -> str:
    require_service("redis")
    return REDIS_URL


SQL_BACKENDS = ["sqlite", "postgres", "mysql"]


@pytest.fixture(params=SQL_BACKENDS)
def sql_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each SQL backend in turn: SQLite (a temp file), PostgreSQL, MariaDB."""
    backend: str = request.param
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'idemq.db'}"
    require_service(backend)
    return PG_URL if backend == "postgres" else MYSQL_URL


def terminate_pg_sessions(application_name: str) -> int:
    """End every PostgreSQL session of ``application_name`` (as a server restart or a network
    cut would, seen from the client); how many there were."""
    import sqlalchemy as sa  # noqa: PLC0415

    admin = sa.create_engine(PG_URL)
    try:
        with admin.begin() as conn:
            ended = conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = :name AND pid <> pg_backend_pid()"
                ),
                {"name": application_name},
            ).all()
        return len(ended)
    finally:
        admin.dispose()


def delete_queues(broker_url: str, queue: str) -> None:
    """Delete ``queue`` and its dead-letter queue (tests share the brokers)."""
    from idemq.brokers import open_broker  # noqa: PLC0415

    broker = open_broker(broker_url)
    try:
        broker.delete_queue(queue)
        broker.delete_queue(broker.dead_letter_queue(queue))
    finally:
        broker.close()


def redis_cleanup(prefix: str) -> None:
    """Delete every key a test's store or lock wrote under ``prefix`` (tests share one Redis)."""
    import redis  # noqa: PLC0415

    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A Redis Cluster of three masters and three replicas, started once for the session from
    the machine's redis-server (skips locally without it, fails under CI=true)."""
    from tests.redis_cluster import start_cluster  # noqa: PLC0415

    cluster = start_cluster()
    yield cluster
    cluster.stop()


def redis_cluster_cleanup(client: Any, prefix: str) -> None:
    """:func:`redis_cleanup` on a Cluster, through a sync Cluster client: redis-py's scan_iter
    visits every master; keys are deleted one by one (each is in a slot of its own)."""
    for key in list(client.scan_iter(match=f"{prefix}*", count=1000)):
        client.delete(key)
