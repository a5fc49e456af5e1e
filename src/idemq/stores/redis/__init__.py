"""The lease store on Redis: one string per record, one round trip per claim."""

from __future__ import annotations

from idemq.stores.redis.store import AsyncRedisStore, RedisStore

__all__ = ["AsyncRedisStore", "RedisStore"]
