"""Store factories for the contract suite: every store, real services."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

import idemq
from idemq.drivers.redis import is_cluster
from tests.conftest import (
    MYSQL_URL,
    PG_URL,
    REDIS_URL,
    redis_cleanup,
    redis_cluster_cleanup,
    require_service,
    unique,
)

# PostgreSQL and MariaDB by name, for tests that run on both and kill a server session.
URL = {"postgres": PG_URL, "mariadb": MYSQL_URL}
SESSION_ID = {"postgres": "SELECT pg_backend_pid()", "mariadb": "SELECT CONNECTION_ID()"}
KILL = {"postgres": "SELECT pg_terminate_backend({})", "mariadb": "KILL {}"}


@pytest.fixture(params=["postgres", "mariadb"])
def server(request: pytest.FixtureRequest) -> str:
    """Each SQL server a test of connections runs on: ``"postgres"`` or ``"mariadb"``."""
    require_service("postgres" if request.param == "postgres" else "mysql")
    return str(request.param)


def kill(server: str, session_id: Any) -> None:
    """End ``server``'s session ``session_id`` from another connection, as an admin would."""
    admin = sa.create_engine(URL[server], poolclass=NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(KILL[server].format(int(session_id)))
    admin.dispose()


class FakeClock:
    """Epoch milliseconds that only move when a test says so."""

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


SQL_STORES = ["sqlite", "postgres", "mariadb", "mysql-generic"]
LEASE_STORES = ["memory", *SQL_STORES, "redis", "redis-cluster"]


# The contract suite moves lease time with FakeClock, so its stores judge leases on the guard's
# clock (lease_clock="client"); tests/contract/test_store_clock.py covers the servers' clocks.
LEASE_CLOCK = "client"


def make_sql_store(
    kind: str, tmp_path: Path, lease_clock: str = LEASE_CLOCK, **options: Any
) -> idemq.SqlStore:
    """A SQL store of ``kind`` on a table of its own; ``options`` go to :class:`idemq.SqlStore`."""
    if kind == "sqlite":
        return idemq.SqlStore(f"sqlite:///{tmp_path / 'idemq.db'}", table=unique("mi"), **options)
    if kind == "postgres":
        require_service("postgres")
        return idemq.SqlStore(PG_URL, table=unique("mi"), lease_clock=lease_clock, **options)
    require_service("mysql")
    # "mysql-generic" runs MySQL 8's plan (INSERT IGNORE + locking read) against MariaDB, so the
    # portable path is proven too, not only MariaDB's one-statement RETURNING claim.
    flavor = "mysql" if kind == "mysql-generic" else None
    return idemq.SqlStore(
        MYSQL_URL, table=unique("mi"), mysql_flavor=flavor, lease_clock=lease_clock, **options
    )


def make_store(
    kind: str,
    tmp_path: Path,
    request: pytest.FixtureRequest | None = None,
    lease_clock: str = LEASE_CLOCK,
) -> Any:
    if kind == "memory":
        return idemq.MemoryStore()
    if kind == "redis":
        require_service("redis")
        return idemq.RedisStore(
            REDIS_URL, prefix=unique("idemqtest"), ttl_s=600, lease_clock=lease_clock
        )
    if kind == "redis-cluster":
        # The session's own cluster (three masters, three replicas), through a ?cluster=true URL.
        assert request is not None, "the redis-cluster store needs the test's request"
        cluster = request.getfixturevalue("redis_cluster")
        return idemq.RedisStore(
            cluster.url, prefix=unique("idemqtest"), ttl_s=600, lease_clock=lease_clock
        )
    store = make_sql_store(kind, tmp_path, lease_clock)
    store.create_schema()
    return store


def dispose(store: Any) -> None:
    if isinstance(store, idemq.SqlStore):
        store.drop_schema()
    elif isinstance(store, idemq.RedisStore) and is_cluster(store.client):
        redis_cluster_cleanup(store.client, store.prefix)
    elif isinstance(store, idemq.RedisStore):
        redis_cleanup(store.prefix)
    store.close()


@pytest.fixture(params=LEASE_STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """Every store, for lease-mode contract tests."""
    made = make_store(request.param, tmp_path, request)
    yield made
    dispose(made)


@pytest.fixture(params=SQL_STORES)
def sql_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[idemq.SqlStore]:
    """Every SQL store, for transactional-mode tests."""
    made = make_store(request.param, tmp_path)
    yield made
    dispose(made)
