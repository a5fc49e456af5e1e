"""A real Django project on fresh databases: PostgreSQL, MariaDB and a SQLite file.

One Django per pytest process (``django.setup()`` runs once): the three databases are the
aliases ``sqlite``, ``pg`` and ``maria`` of one ``DATABASES`` (``default`` is the SQLite file).
Subprocesses (``manage.py``, servers, workers, racing clients) get a ``DATABASES`` whose
``default`` is the database under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.conftest import CI, MYSQL_URL, PG_URL, port_open

ROOT = Path(__file__).resolve().parents[3]
MANAGE = Path(__file__).with_name("manage.py")
SETTINGS = "tests.integration.django.djproject.settings"
ALIASES = ["sqlite", "pg", "maria"]


def _server_db(url: str, name: str, create: bool) -> None:
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            if create:
                conn.exec_driver_sql(f"CREATE DATABASE {name}")
            elif engine.dialect.name == "postgresql":
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            else:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
    finally:
        engine.dispose()


def _available(alias: str) -> bool:
    if alias == "sqlite":
        return True
    return port_open("127.0.0.1", 5432 if alias == "pg" else 3306)


@pytest.fixture(scope="session")
def databases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    """``DATABASES`` of fresh databases, made for this session and dropped after it."""
    name = f"idemq_dj_{uuid.uuid4().hex[:8]}"
    sqlite_file = tmp_path_factory.mktemp("django") / "db.sqlite3"
    dbs: dict[str, dict[str, Any]] = {
        "sqlite": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(sqlite_file),
            # Racing writers queue at BEGIN instead of failing on a lock upgrade.
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 30},
        },
    }
    # What Django's test runner gives a SQLite project: a database in memory, one per connection.
    dbs["memory"] = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
    made: list[tuple[str, str]] = []
    if _available("pg"):
        _server_db(PG_URL, name, True)
        made.append((PG_URL, name))
        dbs["pg"] = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": "5432",
        }
    if _available("maria"):
        _server_db(MYSQL_URL, name, True)
        made.append((MYSQL_URL, name))
        dbs["maria"] = {
            "ENGINE": "django.db.backends.mysql",
            "NAME": name,
            "USER": "root",
            "HOST": "127.0.0.1",
            "PORT": "3306",
            "OPTIONS": {"charset": "utf8mb4"},
        }
    dbs["default"] = dbs["sqlite"]
    try:
        yield dbs
    finally:
        from django.db import connections  # noqa: PLC0415

        connections.close_all()
        for url, db in made:
            _server_db(url, db, False)


@pytest.fixture(scope="session")
def django_project(databases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Django set up in this process on ``databases``, every alias migrated."""
    os.environ["IDEMQ_DJ_DATABASES"] = json.dumps(databases)
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
    import django  # noqa: PLC0415
    from django.core.management import call_command  # noqa: PLC0415

    django.setup()
    for alias in databases:
        if alias != "default":
            call_command("migrate", database=alias, verbosity=0)
    return databases


@pytest.fixture(params=ALIASES)
def alias(request: pytest.FixtureRequest, django_project: dict[str, Any]) -> str:
    """Each database in turn (skipped locally when its server is down, failed under CI)."""
    name: str = request.param
    if name not in django_project:
        if CI:
            pytest.fail(f"{name} is not reachable (CI=true)")
        pytest.skip(f"{name} is not reachable")
    return name


def subprocess_env(
    databases: dict[str, dict[str, Any]], alias: str, **extra: str
) -> dict[str, str]:
    """The environment of a project subprocess whose ``default`` database is ``alias``."""
    env = dict(os.environ)
    env["IDEMQ_DJ_DATABASES"] = json.dumps({"default": databases[alias]})
    env["DJANGO_SETTINGS_MODULE"] = SETTINGS
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def manage(
    databases: dict[str, dict[str, Any]], alias: str, *args: str, check: bool = True, **extra: str
) -> subprocess.CompletedProcess[str]:
    """``python manage.py ARGS`` of the test project on ``alias``."""
    return subprocess.run(
        [sys.executable, str(MANAGE), *args],
        env=subprocess_env(databases, alias, **extra),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=check,
    )


def payments(alias: str, order_id: str) -> int:
    """How many payments (effects) ``order_id`` has on database ``alias``."""
    from tests.integration.django.shop.models import Payment  # noqa: PLC0415 -- after setup

    return int(Payment.objects.using(alias).filter(order_id=order_id).count())


def pay(alias: str, order_id: str, amount: int = 5) -> None:
    """One effect: a payment row written through the ORM."""
    from tests.integration.django.shop.models import Payment  # noqa: PLC0415 -- after setup

    Payment.objects.using(alias).create(order_id=order_id, amount=amount)


def sa_url(databases: dict[str, dict[str, Any]], alias: str) -> str:
    """A SQLAlchemy URL of database ``alias`` (for idemq's own ``SqlStore`` and CLI)."""
    settings = databases[alias]
    if alias == "sqlite":
        return f"sqlite:///{settings['NAME']}"
    base = PG_URL if alias == "pg" else MYSQL_URL
    return sa.make_url(base).set(database=settings["NAME"]).render_as_string(hide_password=False)


@pytest.fixture
def stores() -> Iterator[list[Any]]:
    """Stores a test makes (appended by it), closed after it."""
    made: list[Any] = []
    yield made
    for store in made:
        store.close()
