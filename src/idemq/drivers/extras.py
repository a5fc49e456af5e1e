"""Which of idemq's extras brings which client library, and the one way to say it is missing."""

from __future__ import annotations

from idemq.errors import ConfigurationError

__all__ = ["SQL_DRIVER_EXTRAS", "install_hint", "missing_extra"]

SQL_DRIVER_EXTRAS = {
    "psycopg": "postgres",
    "pymysql": "mysql",
    "asyncmy": "mysql",
    "aiosqlite": "sqlite",
}
"""SQLAlchemy driver name → the idemq extra that installs it."""


def install_hint(extra: str) -> str:
    """The command that installs ``extra``, quoted so that no shell globs its brackets."""
    return f"pip install 'idemq[{extra}]'"


def missing_extra(what: str, extra: str, error: ImportError) -> ConfigurationError:
    """The error for ``what`` needing a library that ``extra`` installs (``error``: why)."""
    missing = error.name or str(error)
    return ConfigurationError(
        f"{what} needs {missing}, which is not installed: {install_hint(extra)}"
    )
