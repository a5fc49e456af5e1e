"""The SQLAlchemy URL of a Django database (``DATABASES[using]``), for what idemq runs on a
connection of its own: lease-mode claims (they commit on their own, whatever transaction the
caller has open), the operator's commands, ``python manage.py idemq``."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import URL

from idemq.errors import ConfigurationError

__all__ = ["database_url"]

# Django's DB-API module → the SQLAlchemy driver that speaks to it.
_DRIVERS = {
    "psycopg": "postgresql+psycopg",
    "psycopg2": "postgresql+psycopg2",
    "pymysql": "mysql+pymysql",
    "MySQLdb": "mysql+mysqldb",
    "sqlite3": "sqlite+pysqlite",
}


def database_url(
    settings_dict: dict[str, Any], dbapi_name: str, *, own_connection: bool = True
) -> URL:
    """The URL of the database ``settings_dict`` (a connection's ``settings_dict``) names, on
    the driver Django uses (``dbapi_name``: its DB-API module's name). ``own_connection``:
    the URL is for a connection of idemq's own, so an in-memory SQLite database (one per
    connection: another would see none of Django's tables) is refused."""
    drivername = _DRIVERS.get(dbapi_name.split(".", maxsplit=1)[0])
    if drivername is None:
        raise ConfigurationError(
            f"idemq runs on Django's PostgreSQL, MySQL/MariaDB and SQLite backends, not on "
            f"{settings_dict.get('ENGINE')!r} (driver {dbapi_name!r})"
        )
    name = str(settings_dict.get("NAME") or "")
    if drivername.startswith("sqlite"):
        in_memory = not name or name == ":memory:" or "mode=memory" in name
        if in_memory and not own_connection:
            return URL.create(drivername, database=":memory:")
        if in_memory or name.startswith("file:"):
            raise ConfigurationError(
                "idemq's own connection (lease mode, the operator's commands) needs a SQLite "
                f"database file, not {name or 'an in-memory database'!r}"
            )
        return URL.create(drivername, database=name)
    options = settings_dict.get("OPTIONS") or {}
    query: dict[str, str] = {}
    if drivername.startswith("postgresql"):
        for option in ("sslmode", "sslrootcert", "sslcert", "sslkey", "application_name"):
            if option in options:
                query[option] = str(options[option])
    port = settings_dict.get("PORT")
    return URL.create(
        drivername,
        username=settings_dict.get("USER") or None,
        password=settings_dict.get("PASSWORD") or None,
        host=settings_dict.get("HOST") or None,
        port=int(port) if port else None,
        database=name or None,
        query=query,
    )
