"""The SQLAlchemy URL made from ``DATABASES`` and the ``--store`` that ``manage.py idemq`` adds."""

from __future__ import annotations

import pytest

import idemq
from idemq.integrations.django._urls import database_url
from idemq.integrations.django.management.commands.idemq import with_store


def test_database_url_per_backend():
    pg = database_url(
        {
            "NAME": "shop",
            "USER": "app",
            "PASSWORD": "s3cret",
            "HOST": "db",
            "PORT": "5433",
            "OPTIONS": {"sslmode": "verify-full"},
        },
        "psycopg",
    )
    assert pg.render_as_string(hide_password=False) == (
        "postgresql+psycopg://app:s3cret@db:5433/shop?sslmode=verify-full"
    )
    maria = database_url({"NAME": "shop", "USER": "root", "HOST": "127.0.0.1"}, "pymysql")
    assert maria.render_as_string() == "mysql+pymysql://root@127.0.0.1/shop"
    lite = database_url({"NAME": "/srv/db.sqlite3"}, "sqlite3.dbapi2")
    assert lite.render_as_string() == "sqlite+pysqlite:////srv/db.sqlite3"


def test_in_memory_sqlite_and_other_backends_are_refused():
    with pytest.raises(idemq.ConfigurationError, match="SQLite database file"):
        database_url({"NAME": ":memory:"}, "sqlite3")
    with pytest.raises(idemq.ConfigurationError, match="oracledb"):
        database_url({"NAME": "x", "ENGINE": "django.db.backends.oracle"}, "oracledb")


def test_store_is_added_only_where_the_subcommand_takes_one():
    url = "sqlite:////srv/db.sqlite3"
    assert with_store(["stats", "--json"], url) == ["stats", "--json", "--store", url]
    assert with_store(["schema", "upgrade"], url) == ["schema", "upgrade", "--store", url]
    assert with_store(["outbox", "retry", "ID"], url) == ["outbox", "retry", "ID", "--store", url]
    assert with_store(["id", "new"], url) == ["id", "new"]
    assert with_store(["schema", "--dialect", "sqlite"], url) == ["schema", "--dialect", "sqlite"]
    assert with_store(["stats", "--store=redis://r"], url) == ["stats", "--store=redis://r"]
