"""Driver errors become idemq errors at the boundary, with the cause kept and no password shown."""

from __future__ import annotations

import socket

import pytest

import idemq


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PG = "postgresql+psycopg://postgres:s3cret-pw@127.0.0.1:{port}/test"
MARIADB = "mysql+pymysql://root:s3cret-pw@127.0.0.1:{port}/test"
REDIS = "redis://:s3cret-pw@127.0.0.1:{port}/0"


@pytest.mark.parametrize(
    ("url", "mode"),
    [
        (PG, "transactional"),
        (PG, "lease"),
        (MARIADB, "transactional"),
        (MARIADB, "lease"),
        (REDIS, "lease"),
    ],
    ids=["postgres-tx", "postgres-lease", "mariadb-tx", "mariadb-lease", "redis-lease"],
)
def test_unreachable_store_is_store_unavailable_without_the_password(url, mode):
    store = idemq.open_store(url.format(port=closed_port()))
    guard = idemq.Idempotency(store, consumer="c", mode=mode)
    ran = []
    try:
        with pytest.raises(idemq.StoreUnavailableError) as info:
            guard.process("M", lambda tx: ran.append(1))
    finally:
        store.close()
    assert ran == [], "nothing may run when the claim could not be made"
    assert info.value.__cause__ is not None, "the driver error is kept as the cause"
    for text in (str(info.value), repr(store)):
        assert "s3cret-pw" not in text


def test_bad_url_is_a_configuration_error():
    with pytest.raises(idemq.ConfigurationError):
        idemq.SqlStore("not a url at all")
    with pytest.raises(idemq.ConfigurationError):
        idemq.SqlStore("nosuchdialect://x")
