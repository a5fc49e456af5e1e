"""Store factories for the contract suite: every store, real services."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import idemq
from tests.conftest import MYSQL_URL, PG_URL, REDIS_URL, redis_cleanup, require_service, unique


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
LEASE_STORES = ["memory", *SQL_STORES, "redis"]


def make_sql_store(kind: str, tmp_path: Path) -> idemq.SqlStore:
    if kind == "sqlite":
        return idemq.SqlStore(f"sqlite:///{tmp_path / 'idemq.db'}", table=unique("mi"))
    if kind == "postgres":
        require_service("postgres")
        return idemq.SqlStore(PG_URL, table=unique("mi"))
    require_service("mysql")
    # "mysql-generic" runs MySQL 8's plan (INSERT IGNORE + locking read) against MariaDB, so the
    # portable path is proven too, not only MariaDB's one-statement RETURNING claim.
    flavor = "mysql" if kind == "mysql-generic" else None
    return idemq.SqlStore(MYSQL_URL, table=unique("mi"), mysql_flavor=flavor)


def make_store(kind: str, tmp_path: Path) -> Any:
    if kind == "memory":
        return idemq.MemoryStore()
    if kind == "redis":
        require_service("redis")
        return idemq.RedisStore(REDIS_URL, prefix=unique("idemqtest"), ttl_s=600)
    store = make_sql_store(kind, tmp_path)
    store.create_schema()
    return store


def dispose(store: Any) -> None:
    if isinstance(store, idemq.SqlStore):
        store.drop_schema()
    elif isinstance(store, idemq.RedisStore):
        redis_cleanup(store.prefix)
    store.close()


@pytest.fixture(params=LEASE_STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """Every store, for lease-mode contract tests."""
    made = make_store(request.param, tmp_path)
    yield made
    dispose(made)


@pytest.fixture(params=SQL_STORES)
def sql_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[idemq.SqlStore]:
    """Every SQL store, for transactional-mode tests."""
    made = make_store(request.param, tmp_path)
    yield made
    dispose(made)
