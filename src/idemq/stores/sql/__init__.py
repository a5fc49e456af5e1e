"""The dedup table in SQL: SQLite, PostgreSQL and MariaDB/MySQL, sync and async."""

from __future__ import annotations

from idemq.stores.sql.store import SqlStore, schema_sql
from idemq.stores.sql.store_async import AsyncSqlStore

__all__ = ["AsyncSqlStore", "SqlStore", "schema_sql"]
