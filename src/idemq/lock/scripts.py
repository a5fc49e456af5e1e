"""The Lua scripts and sans-I/O operations behind :class:`~idemq.RedisLock` (sync and async).

Correctness lives on the server: every script compares the caller's random owner token with the
lock's value in the same atomic step as it acts, so no client-side GET-then-act window exists.
Extending is :data:`~idemq.drivers.redis.EXTEND_IF_OWNER`, the script node leases renew with too.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from idemq._backoff import Backoff
from idemq.drivers.redis import (
    EXTEND_IF_OWNER,
    Call,
    LuaScript,
    Op,
    Pause,
    RunScript,
    escape_key_part,
)
from idemq.errors import ConfigurationError, StoreError

__all__ = [
    "ACQUIRE",
    "OWNED",
    "RELEASE",
    "LockKeys",
    "acquire",
    "extend",
    "locked",
    "owned",
    "release",
    "renew",
]

ACQUIRE = LuaScript(
    "lock_acquire",
    """
-- KEYS[1] lock key   KEYS[2] fencing counter (same hash tag, so same Cluster slot)
-- ARGV[1] owner token   ARGV[2] ttl_ms
-- Returns the fencing token (> 0) when ARGV[1] now holds the lock, 0 when someone else does.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if redis.call('EXISTS', KEYS[2]) == 0 then
    -- First use, or the counter was lost (restart without persistence, eviction): restart it
    -- from the server's clock in microseconds, which grows far faster than one token per
    -- acquire, so a new token still beats every token issued before the loss.
    local now = redis.call('TIME')
    redis.call('SET', KEYS[2], now[1] .. string.format('%06d', tonumber(now[2])))
  end
  return redis.call('INCR', KEYS[2])
end
-- Our own acquire replayed by a client retry after a lost reply: nobody can have acquired
-- since (we hold the lock), so the counter still holds our token.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return tonumber(redis.call('GET', KEYS[2]))
end
return 0
""",
)

RELEASE = LuaScript(
    "lock_release",
    """
-- KEYS[1] lock key   ARGV[1] owner token
-- Returns 1 when the lock was ARGV[1]'s and is now deleted, 0 when it was not ARGV[1]'s
-- (expired, maybe re-acquired by another owner, whose lock must survive).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
""",
)

OWNED = LuaScript(
    "lock_owned",
    """
-- KEYS[1] lock key   ARGV[1] owner token
-- Returns 1 when ARGV[1] holds the lock now, 0 otherwise (compared on the server).
if redis.call('GET', KEYS[1]) == ARGV[1] then return 1 end
return 0
""",
)


@dataclass(frozen=True, slots=True)
class LockKeys:
    """The lock key and its fencing counter, sharing one hash tag (one Cluster slot)."""

    lock: str
    fence: str

    @classmethod
    def build(cls, prefix: str, name: str) -> LockKeys:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"lock name must be a non-empty str, got {name!r}")
        if not prefix or "{" in prefix or "}" in prefix:
            raise ConfigurationError(f"prefix must be a non-empty str without braces: {prefix!r}")
        # Percent-encoded: a "}" in the name must not end the hash tag early.
        tag = escape_key_part(name)
        return cls(lock=f"{prefix}:{{{tag}}}", fence=f"{prefix}:{{{tag}}}:fence")

    @property
    def both(self) -> tuple[str, str]:
        return (self.lock, self.fence)


def acquire(
    keys: LockKeys,
    token: str,
    ttl_ms: int,
    *,
    blocking: bool,
    timeout_s: float | None,
    backoff: Backoff,
    rng: random.Random,
    monotonic: Callable[[], float],
) -> Op[int | None]:
    """Try until acquired (→ the fencing token), or ``None`` when non-blocking / timed out."""
    deadline = None if timeout_s is None else monotonic() + timeout_s
    attempt = 0
    while True:
        fence = yield RunScript(ACQUIRE, keys.both, (token, ttl_ms))
        if fence:
            return int(fence)
        if not blocking or (deadline is not None and monotonic() >= deadline):
            return None
        # Jittered (``backoff``'s own): waiters released together by one expiry do not hammer
        # Redis in lock-step.
        attempt += 1
        delay = backoff.delay_s(attempt, rng.random)
        if deadline is not None:
            delay = max(0.0, min(delay, deadline - monotonic()))
        yield Pause(delay)


def release(keys: LockKeys, token: str) -> Op[bool]:
    """True when the lock was ours and is deleted; False when it was not ours (nothing done)."""
    deleted = yield RunScript(RELEASE, (keys.lock,), (token,))
    return bool(deleted)


def extend(keys: LockKeys, token: str, ttl_ms: int) -> Op[bool]:
    """True when the lock is still ours and now lives ``ttl_ms`` more."""
    held = yield RunScript(EXTEND_IF_OWNER, (keys.lock,), (token, ttl_ms))
    return bool(held)


def owned(keys: LockKeys, token: str) -> Op[bool]:
    """True when ``token`` holds the lock right now (one atomic compare on the server)."""
    held = yield RunScript(OWNED, (keys.lock,), (token,))
    return bool(held)


def locked(keys: LockKeys) -> Op[bool]:
    """True when anyone holds the lock right now."""
    held = yield Call("exists", keys.lock)
    return bool(held)


def renew(
    keys: LockKeys,
    token: str,
    ttl_ms: int,
    *,
    interval_s: float,
    max_renewals: int | None,
    monotonic: Callable[[], float],
) -> Op[bool]:
    """The watchdog: extend every ``interval_s`` until stopped; return True if the lock was lost.

    Stops after ``max_renewals`` (a holder stuck in an endless loop must not keep the lock
    forever — the lock then expires as if unrenewed). An outage shorter than the TTL is
    tolerated; once a whole TTL has passed without a successful renewal the lock may have
    expired and been taken, so it is reported lost rather than assumed held.
    """
    renewals = 0
    last_ok = monotonic()
    while max_renewals is None or renewals < max_renewals:
        stopped = yield Pause(interval_s)
        if stopped:
            return False
        try:
            held = yield RunScript(EXTEND_IF_OWNER, (keys.lock,), (token, ttl_ms))
        except StoreError:
            if (monotonic() - last_ok) * 1000 >= ttl_ms:
                return True
            continue
        if not held:
            return True
        renewals += 1
        last_ok = monotonic()
    return False
