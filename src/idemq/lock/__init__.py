"""A Redis distributed lock done right: owner token, server-side compare, renewal, fencing."""

from __future__ import annotations

from idemq.lock.redis_lock import AsyncRedisLock, RedisLock

__all__ = ["AsyncRedisLock", "RedisLock"]
