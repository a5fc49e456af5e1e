"""Dedup stores: SQL (transactional and lease), Redis (lease) and in-memory (tests, demos)."""

from __future__ import annotations

from typing import Any

from idemq.drivers.urls import is_redis_url
from idemq.stores.redis.store import RedisStore
from idemq.stores.sql.store import SqlStore

__all__ = ["is_redis_url", "open_store"]


def open_store(url: str, **options: Any) -> Any:
    """The store a URL names: ``redis://…`` → :class:`~idemq.stores.redis.RedisStore`, any
    SQLAlchemy URL → :class:`~idemq.stores.sql.SqlStore` (``sqlite:///idemq.db``,
    ``postgresql+psycopg://…``, ``mysql+pymysql://…``). ``options`` go to the store."""
    if is_redis_url(url):
        return RedisStore(url, **options)
    return SqlStore(url, **options)


def store_label(store: object) -> str:
    """A short, credential-free name for a store: ``postgresql/message_idempotent``,
    ``redis/idemq``, ``memory``."""
    table = getattr(store, "table", None)
    engine = getattr(store, "engine", None)
    if table is not None and engine is not None:
        return f"{engine.dialect.name}/{table.name}"
    prefix = getattr(store, "prefix", None)
    if isinstance(prefix, str):
        return f"redis/{prefix}"
    return type(store).__name__.removesuffix("Store").lower() or "store"
