"""No password in any error idemq raises from a bad URL, whatever entry point took the URL.

Store and broker URLs carry credentials, and error messages end up in logs and terminals. Every
way into idemq that takes a URL is fed malformed ones holding a password; the error must be of
idemq's tree (never a raw ValueError from a parser) and must not contain the password, nor must
any note added to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import idemq
from idemq.brokers import open_broker
from idemq.drivers.sql import sql_engine
from idemq.ids.timestamp_store import SqlTimestampStore
from idemq.stores import open_store

SECRET = "s3cr3t-Pw"
BAD_URLS = [
    f"postgresql+psycopg://app:{SECRET}@127.0.0.1:notaport/db",
    f"mysql+pymysql://app:{SECRET}@127.0.0.1:99999999999/db",
    f"nosuchdriver://app:{SECRET}@127.0.0.1/db",
    f"redis://app:{SECRET}@127.0.0.1:notaport/0",
    f"amqpx://guest:{SECRET}@127.0.0.1:5672/",
    f"app:{SECRET}@127.0.0.1:5432/db",
]

ENTRY_POINTS: dict[str, Callable[[str], Any]] = {
    "SqlStore": idemq.SqlStore,
    "AsyncSqlStore": idemq.AsyncSqlStore,
    "RedisStore": idemq.RedisStore,
    "open_store": open_store,
    "open_broker": open_broker,
    "sql_engine": sql_engine,
    "SqlTimestampStore": lambda url: SqlTimestampStore(url, key="node"),
}


@pytest.mark.parametrize("url", BAD_URLS)
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_bad_url_is_an_idemq_error_without_the_password(entry: str, url: str):
    try:
        made = ENTRY_POINTS[entry](url)
    except idemq.IdemqError as error:
        text = " ".join([str(error), *getattr(error, "__notes__", [])])
        assert SECRET not in text, f"{entry} leaked the password: {text}"
        return
    except Exception as error:
        pytest.fail(f"{entry}({url!r}) raised {type(error).__name__}: {error}")
    close = getattr(made, "close", None)  # a URL some entry point accepts as it is
    if callable(close):
        result = close()
        if hasattr(result, "__await__"):
            result.close()  # an async store made no connection: nothing to await
