"""A Redis distributed lock done right: owner token, server-side compare, renewal, fencing.

Why the seed's lock (``SETNX lock:<id>`` … ``DEL lock:<id>``) is unsafe, and what fixes it::

    t=0s   A: acquire            SET lock a NX PX 30000; INCR fence → A's fencing token 41
    t=1s   A: pauses             (GC, VM stall, swap, slow network …) — A still "holds" the lock
    t=30s  Redis: TTL expires    lock gone
    t=31s  B: acquire            SET lock b NX PX 30000; INCR fence → B's fencing token 42
    t=32s  B: writes resource    with fence 42 → resource remembers 42
    t=40s  A: wakes, writes      with fence 41 → REFUSED (41 < 42)    ← fencing token
    t=41s  A: release            Lua: GET lock == a? no → LockNotOwnedError, B's lock survives
                                                                      ← owner token
    seed:  A: DEL lock           deletes B's lock; C acquires and runs alongside B

The owner token stops A from *releasing or extending* B's lock; only the fencing token stops
A's late *write*, because nothing a lock does can reach into a paused process. So a resource
that matters must check the token: :func:`idemq.versioned_update` with ``fence=`` does it for a
SQL row (store tokens in a BIGINT column: they start from the server clock in microseconds, so
they stay increasing even if the counter key is lost). ``auto_renew=True`` narrows the window
(a watchdog extends the lock every ⅓ TTL) but cannot close it: a pause longer than the TTL
still loses the lock, which the watchdog then reports through :attr:`RedisLock.lost` and
``on_lost``.

``owned()`` is one Lua compare on the server (read-only, so a GET compared in Python would be
equally safe; the script just keeps every token comparison in one place). A release whose reply
is lost and which redis-py re-sends reports :class:`~idemq.LockNotOwnedError` although the lock
was released: harmless, but do not read it as "someone stole it" without :attr:`lost`.

Errors: Redis unreachable → :class:`~idemq.StoreUnavailableError`; release/extend of a lock not
held → :class:`~idemq.LockNotOwnedError`. The sync and async classes share every script and
every decision (:mod:`idemq.lock.scripts`); they only execute.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

from idemq._backoff import Backoff
from idemq._plan import adrive, drive
from idemq.drivers.redis import (
    AnyAsyncRedis,
    AnyRedis,
    AsyncRedisExecutor,
    Op,
    Pause,
    RedisExecutor,
    Step,
)
from idemq.errors import ConfigurationError, LockError, LockNotOwnedError
from idemq.lock import scripts as ops

__all__ = ["AsyncRedisLock", "RedisLock"]

C = TypeVar("C", AnyRedis, AnyAsyncRedis)

DEFAULT_MAX_RENEWALS = 100
"""With auto_renew, at most this many extensions (every ⅓ TTL: 1000 s for a 30 s lock)."""


class _LockState:
    """What both twins hold: settings, keys, the current token and fencing token."""

    def __init__(
        self,
        name: str,
        ttl_s: float,
        *,
        prefix: str,
        auto_renew: bool,
        max_renewals: int | None,
        on_lost: Callable[[], object] | None,
        blocking_timeout_s: float | None,
        poll_s: float,
        rng: random.Random | None,
        monotonic: Callable[[], float] | None,
    ) -> None:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not ttl_s > 0:
            # No TTL is not an option: a holder that dies would hold the lock forever.
            raise ConfigurationError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
        if max_renewals is not None and max_renewals < 0:
            raise ConfigurationError(f"max_renewals must be >= 0 or None, got {max_renewals!r}")
        self.name = name
        self.keys = ops.LockKeys.build(prefix, name)
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.auto_renew = auto_renew
        self.max_renewals = max_renewals
        self.on_lost = on_lost
        self.blocking_timeout_s = blocking_timeout_s
        # From poll_s up to a quarter of the TTL (at most 0.5 s): a waiter never sleeps through
        # much of a released lock's free time. Half of each wait is random (see acquire).
        self.backoff = Backoff(poll_s, max(poll_s, min(0.5, self.ttl_ms / 4000)), jitter=0.5)
        self.rng = rng or random.Random()
        self.monotonic = monotonic or time.monotonic
        self.token: str | None = None
        self.fence: int | None = None
        self.lost = False

    def acquire_op(self, blocking: bool, timeout_s: float | None) -> Op[int | None]:
        # acquire() without a timeout waits as long as the lock was configured to, like `with`.
        timeout_s = self.blocking_timeout_s if timeout_s is None else timeout_s
        if self.token is not None:
            raise LockError(f"lock {self.name!r} is already held by this object (not re-entrant)")
        token = secrets.token_hex(16)  # random per acquire: a stale holder can never match
        fence = yield from ops.acquire(
            self.keys,
            token,
            self.ttl_ms,
            blocking=blocking,
            timeout_s=timeout_s,
            backoff=self.backoff,
            rng=self.rng,
            monotonic=self.monotonic,
        )
        if fence is not None:
            self.token, self.fence, self.lost = token, fence, False
        return fence

    def held_token(self, action: str) -> str:
        if self.token is None:
            raise LockNotOwnedError(f"cannot {action} lock {self.name!r}: not acquired")
        return self.token

    def release_op(self) -> Op[None]:
        token = self.held_token("release")
        released = yield from ops.release(self.keys, token)  # unreachable: token kept, retry
        self.token = None
        if not released:
            raise LockNotOwnedError(
                f"lock {self.name!r} expired before release (maybe taken by another owner); "
                "its lock was left alone"
            )

    def extend_op(self, ttl_s: float | None) -> Op[None]:
        token = self.held_token("extend")
        ttl_ms = self.ttl_ms if ttl_s is None else max(1, round(ttl_s * 1000))
        if not (yield from ops.extend(self.keys, token, ttl_ms)):
            self.token, self.lost = None, True
            raise LockNotOwnedError(f"lock {self.name!r} expired before extend")

    def locked_op(self) -> Op[bool]:
        return ops.locked(self.keys)

    def owned_op(self) -> Op[bool]:
        if self.token is None:
            return False
        return (yield from ops.owned(self.keys, self.token))

    def renew_op(self, token: str) -> Op[bool]:
        return ops.renew(
            self.keys,
            token,
            self.ttl_ms,
            interval_s=self.ttl_ms / 3000,
            max_renewals=self.max_renewals,
            monotonic=self.monotonic,
        )

    def mark_lost(self, token: str) -> None:
        if self.token == token:
            self.lost = True
            if self.on_lost is not None:
                self.on_lost()

    def fencing_token(self) -> int:
        if self.fence is None:
            raise LockError(f"lock {self.name!r} was never acquired: no fencing token yet")
        return self.fence


class _LockShell(Generic[C]):
    """What the sync and the async lock share: the constructor, the state, the read-only
    properties. They differ only in their executor and in how they pause and run the
    watchdog."""

    _server: str

    def __init__(
        self,
        client: C,
        name: str,
        ttl_s: float = 30,
        *,
        prefix: str = "idemq:lock",
        auto_renew: bool = False,
        max_renewals: int | None = DEFAULT_MAX_RENEWALS,
        on_lost: Callable[[], object] | None = None,
        blocking_timeout_s: float | None = None,
        poll_s: float = 0.01,
        rng: random.Random | None = None,
        monotonic: Callable[[], float] | None = None,
    ) -> None:
        self._state = _LockState(
            name,
            ttl_s,
            prefix=prefix,
            auto_renew=auto_renew,
            max_renewals=max_renewals,
            on_lost=on_lost,
            blocking_timeout_s=blocking_timeout_s,
            poll_s=poll_s,
            rng=rng,
            monotonic=monotonic,
        )
        self._init_shell(client)

    def _init_shell(self, client: C) -> None:
        """Build the executor for ``client`` and the watchdog's stop signal."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._state.name!r}, {self._server})"

    @property
    def name(self) -> str:
        """The lock's name (the resource it guards)."""
        return self._state.name

    @property
    def fencing_token(self) -> int:
        """The token issued by the last successful acquire (strictly increasing per name)."""
        return self._state.fencing_token()

    @property
    def lost(self) -> bool:
        """True once the watchdog (or ``extend``) found the lock taken or expired."""
        return self._state.lost


class RedisLock(_LockShell[AnyRedis]):
    """A distributed lock on Redis with an owner token and a fencing token.

    ``acquire(blocking=True, timeout_s=None) -> bool``; :meth:`release` and :meth:`extend` raise
    :class:`~idemq.LockNotOwnedError` when the lock expired meanwhile; ``with lock:`` acquires
    (blocking, ``blocking_timeout_s``) or raises :class:`~idemq.LockError`.
    :attr:`fencing_token` is strictly increasing per lock name: pass it to every write the lock
    protects. ``auto_renew=True`` starts a watchdog thread extending the lock every ⅓ TTL, at
    most ``max_renewals`` times; on loss it sets :attr:`lost` and calls ``on_lost()`` (from the
    watchdog thread). ``rng``/``monotonic`` are injectable for deterministic tests.
    """

    def _init_shell(self, client: AnyRedis) -> None:
        self._redis = RedisExecutor(client)
        self._server = self._redis.server
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    def _execute(self, step: Step, stop: threading.Event | None = None) -> Any:
        if isinstance(step, Pause):
            if stop is None:
                time.sleep(step.seconds)
                return False
            return stop.wait(step.seconds)
        return self._redis(step)

    def acquire(self, blocking: bool = True, timeout_s: float | None = None) -> bool:
        """Take the lock; False only when non-blocking or the wait ran out (``timeout_s``,
        default the lock's ``blocking_timeout_s``; both None: wait as long as it takes)."""
        fence = drive(self._state.acquire_op(blocking, timeout_s), self._execute)
        if fence is None:
            return False
        if self._state.auto_renew:
            self._start_watchdog()
        return True

    def release(self) -> None:
        """Release the lock; :class:`~idemq.LockNotOwnedError` if it was no longer ours."""
        self._stop_watchdog()
        drive(self._state.release_op(), self._execute)

    def extend(self, ttl_s: float | None = None) -> None:
        """Reset the remaining time to live to ``ttl_s`` (default: the lock's TTL)."""
        drive(self._state.extend_op(ttl_s), self._execute)

    def owned(self) -> bool:
        """Whether this object holds the lock right now (one atomic compare on the server)."""
        return drive(self._state.owned_op(), self._execute)

    def locked(self) -> bool:
        """Whether anyone holds the lock right now."""
        return drive(self._state.locked_op(), self._execute)

    def _start_watchdog(self) -> None:
        token = self._state.held_token("renew")
        self._stop = threading.Event()
        stop = self._stop

        def watch() -> None:
            if drive(self._state.renew_op(token), lambda step: self._execute(step, stop)):
                self._state.mark_lost(token)

        self._watchdog = threading.Thread(target=watch, name=f"idemq-lock-{self.name}", daemon=True)
        self._watchdog.start()

    def _stop_watchdog(self) -> None:
        self._stop.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join()
        self._watchdog = None

    def __enter__(self) -> RedisLock:
        if not self.acquire(blocking=True, timeout_s=self._state.blocking_timeout_s):
            raise LockError(
                f"could not acquire lock {self.name!r} within {self._state.blocking_timeout_s} s"
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.release()
        except LockNotOwnedError:
            # Losing the lock mid-body means its writes may have raced another holder: say so,
            # unless the body already failed — then its own error is the one to see.
            if exc is None:
                raise


class AsyncRedisLock(_LockShell[AnyAsyncRedis]):
    """Async twin of :class:`RedisLock` (``redis.asyncio.Redis``); the watchdog is a task."""

    def _init_shell(self, client: AnyAsyncRedis) -> None:
        self._redis = AsyncRedisExecutor(client)
        self._server = self._redis.server
        self._stop = asyncio.Event()
        self._watchdog: asyncio.Task[None] | None = None

    async def _execute(self, step: Step, stop: asyncio.Event | None = None) -> Any:
        if isinstance(step, Pause):
            if stop is None:
                await asyncio.sleep(step.seconds)
                return False
            try:
                await asyncio.wait_for(stop.wait(), step.seconds)
            except TimeoutError:
                return False
            return True
        return await self._redis(step)

    async def acquire(self, blocking: bool = True, timeout_s: float | None = None) -> bool:
        """See :meth:`RedisLock.acquire`."""
        fence = await adrive(self._state.acquire_op(blocking, timeout_s), self._execute)
        if fence is None:
            return False
        if self._state.auto_renew:
            token = self._state.held_token("renew")
            self._stop = asyncio.Event()
            self._watchdog = asyncio.create_task(self._watch(token, self._stop))
        return True

    async def _watch(self, token: str, stop: asyncio.Event) -> None:
        async def execute(step: Step) -> Any:
            return await self._execute(step, stop)

        if await adrive(self._state.renew_op(token), execute):
            self._state.mark_lost(token)

    async def release(self) -> None:
        """See :meth:`RedisLock.release`."""
        self._stop.set()
        if self._watchdog is not None:
            await self._watchdog
            self._watchdog = None
        await adrive(self._state.release_op(), self._execute)

    async def extend(self, ttl_s: float | None = None) -> None:
        """See :meth:`RedisLock.extend`."""
        await adrive(self._state.extend_op(ttl_s), self._execute)

    async def owned(self) -> bool:
        """See :meth:`RedisLock.owned`."""
        return await adrive(self._state.owned_op(), self._execute)

    async def locked(self) -> bool:
        """See :meth:`RedisLock.locked`."""
        return await adrive(self._state.locked_op(), self._execute)

    async def __aenter__(self) -> AsyncRedisLock:
        if not await self.acquire(blocking=True, timeout_s=self._state.blocking_timeout_s):
            raise LockError(
                f"could not acquire lock {self.name!r} within {self._state.blocking_timeout_s} s"
            )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.release()
        except LockNotOwnedError:
            if exc is None:
                raise
