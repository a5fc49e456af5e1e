"""The redis-py boundary: clients from URLs, Lua script steps and their executors, errors.

Everything idemq does on Redis (the store, the lock, node leases, id reservations) is written
once as a plan: a generator that yields :data:`Step` values (run a Lua script, call a command,
send a pipeline, pause) and receives their replies (:mod:`idemq._plan`). A
:class:`RedisExecutor` or :class:`AsyncRedisExecutor` carries the steps out, so the sync and
async shells of each object differ only in which executor they hold, and the logic of a claim,
a SCAN loop or a blocking lock acquire cannot drift between them.

The executors go through redis-py's public doors only: a script is a ``register_script``
object (it sends EVALSHA and, when the server answers NOSCRIPT after a restart, a
``SCRIPT FLUSH`` or a failover, loads the source and repeats), a command is the client method
of that name, and redis-py encodes every argument and parses every reply.

Errors: a redis-py exception is translated here, once, into
:class:`~idemq.errors.StoreUnavailableError` (cannot reach / timed out / failover in progress)
or :class:`~idemq.errors.StoreError` (anything else), always ``from exc``. Messages name the
server as ``host:port/db``, never the URL, so a password in it cannot leak into a log.
"""

from __future__ import annotations

import codecs
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote, unquote

import redis
import redis.asyncio
from redis import exceptions as rx

from idemq.drivers.urls import mask_url
from idemq.errors import ConfigurationError, StoreError, StoreUnavailableError

__all__ = [
    "DEFAULT_SOCKET_TIMEOUT_S",
    "EXTEND_IF_OWNER",
    "AsyncRedisExecutor",
    "Batch",
    "Call",
    "LuaScript",
    "Op",
    "Pause",
    "RedisExecutor",
    "RunScript",
    "Step",
    "describe_server",
    "escape_key_part",
    "redis_client",
    "require_utf8",
    "text",
    "translate_error",
    "unescape_key_part",
]

T = TypeVar("T")
C = TypeVar("C", redis.Redis, redis.asyncio.Redis)


@dataclass(frozen=True, slots=True)
class LuaScript:
    """A Lua script's source and its name (for error messages)."""

    name: str
    source: str


@dataclass(frozen=True, slots=True)
class RunScript:
    """Run a :class:`LuaScript` (one round trip); the reply is the script's return."""

    script: LuaScript
    keys: Sequence[str | bytes]
    args: Sequence[str | bytes | int]


class Call:
    """One redis-py command, named by its client method, with that method's arguments.

    ``Call("set", key, value, nx=True, px=ttl_ms)`` is ``client.set(key, value, nx=True,
    px=ttl_ms)``, or the same command queued on a pipeline: a plan reads like the redis-py call
    it makes, and the reply is what that method documents.
    """

    __slots__ = ("args", "kwargs", "method")

    def __init__(self, method: str, /, *args: Any, **kwargs: Any) -> None:
        self.method = method
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        arguments = [*map(repr, self.args), *(f"{k}={v!r}" for k, v in self.kwargs.items())]
        return f"Call({self.method!r}, {', '.join(arguments)})"

    def run_on(self, client: Any) -> Any:
        """Call the command on ``client``: the reply (sync), an awaitable of it (async), or the
        pipeline itself (queued)."""
        return getattr(client, self.method)(*self.args, **self.kwargs)


@dataclass(frozen=True, slots=True)
class Batch:
    """Several commands in one pipelined round trip (no MULTI: each reply is independent)."""

    calls: tuple[Call, ...]


@dataclass(frozen=True, slots=True)
class Pause:
    """Wait ``seconds`` (only the lock uses it: polling, renewal); the reply is ``True`` when the
    wait was cut short because the owner asked to stop, else ``False``. The lock's shells carry
    it out themselves; the executors refuse it."""

    seconds: float


Step = RunScript | Call | Batch | Pause
Op = Generator[Step, Any, T]
"""An operation: yields steps, receives each step's reply, returns its result."""


EXTEND_IF_OWNER = LuaScript(
    "extend_if_owner",
    """
-- KEYS[1] key holding an owner token   ARGV[1] owner token   ARGV[2] ttl_ms
-- Returns 1 when ARGV[1] still holds the key and it now expires ARGV[2] ms from now, 0
-- otherwise. Compare and act in one script: a GET then PEXPIRE from the client could extend
-- a key another owner took in between.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
""",
)
"""The lock's extend and watchdog, and a node lease's renewal and release (a short hold)."""


def escape_key_part(value: str) -> str:
    """``value`` percent-encoded for a key: only ``[A-Za-z0-9_.~-]`` and ``%XX`` remain.

    Names and ids are arbitrary text. A raw ``}`` would end a Cluster hash tag early, a raw
    ``:`` would make two different pairs of parts one key, and a raw ``*``/``?``/``[`` would
    turn a SCAN pattern into a wildcard. ``surrogatepass`` gives even a lone surrogate a key.
    """
    return quote(value, safe="", encoding="utf-8", errors="surrogatepass")


def unescape_key_part(value: str) -> str:
    """The text :func:`escape_key_part` encoded."""
    return unquote(value, encoding="utf-8", errors="surrogatepass")


def text(value: bytes | str) -> str:
    """A reply value as ``str`` whether the client decodes responses or not.

    ``surrogatepass`` mirrors how idemq encodes a result it writes, so any ``str`` round-trips.
    """
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogatepass")
    return value


# Server-side states in which the command did not run and will succeed after a failover or
# restart: the caller must retry the message later, exactly like a refused connection.
_UNAVAILABLE_REPLIES = (
    "LOADING",
    "READONLY",
    "MASTERDOWN",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "MOVED",
    "ASK",
    "NOREPLICAS",
    "BUSY",
    "NOSCRIPT",
)


def translate_error(exc: rx.RedisError, action: str, server: str) -> StoreError:
    """The idemq error for a redis-py failure of ``action`` on ``server``; raise it ``from exc``."""
    reason = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, rx.ConnectionError | rx.TimeoutError):  # BusyLoadingError included
        return StoreUnavailableError(f"redis {server} unavailable during {action} ({reason})")
    if isinstance(exc, rx.ResponseError) and str(exc).startswith(_UNAVAILABLE_REPLIES):
        return StoreUnavailableError(f"redis {server} not serving {action} ({reason})")
    if isinstance(exc, rx.ResponseError) and str(exc).startswith("syntax error"):
        # idemq's commands are fixed; a server that cannot parse them is too old (SET … NX GET).
        return StoreError(f"redis {server} rejected {action} ({reason}): idemq needs Redis >= 7.0")
    return StoreError(f"redis {server} failed {action} ({reason})")


def describe_server(connection_kwargs: Mapping[str, Any]) -> str:
    """``host:port/db`` (or the socket path) of a client, never its password."""
    if connection_kwargs.get("path"):
        return f"unix:{connection_kwargs['path']}/{connection_kwargs.get('db', 0)}"
    host = connection_kwargs.get("host", "localhost")
    port = connection_kwargs.get("port", 6379)
    return f"{host}:{port}/{connection_kwargs.get('db', 0)}"


DEFAULT_SOCKET_TIMEOUT_S = 5.0
"""For clients idemq builds from a URL: a hung server becomes StoreUnavailableError, not a hang."""

_SCHEMES = ("redis", "rediss", "unix")


def redis_client(
    client_or_url: C | str,
    kind: type[C],
    *,
    socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
) -> C:
    """A redis-py client of ``kind`` (``redis.Redis`` or ``redis.asyncio.Redis``): ``client_or_url``
    itself when it is one, else one built from a ``redis://``, ``rediss://`` or ``unix://`` URL
    with ``socket_timeout_s`` for connecting and for every reply (the caller owns and closes a
    client built here). Raises :class:`~idemq.ConfigurationError` for anything else."""
    if isinstance(client_or_url, kind):
        return client_or_url
    if not isinstance(client_or_url, str):
        raise ConfigurationError(
            f"needs a {kind.__module__}.{kind.__name__} or a Redis URL, "
            f"got {type(client_or_url).__name__}"
        )
    url = client_or_url
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise ConfigurationError(
            f"not a Redis URL (redis://, rediss:// or unix://): {mask_url(url)}"
        )
    try:
        return kind.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
        )
    except ValueError as exc:
        raise ConfigurationError(f"invalid Redis URL {mask_url(url)}: {exc}") from exc


def require_utf8(client: redis.Redis | redis.asyncio.Redis, user: str) -> None:
    """Refuse a client that would encode idemq's text other than as UTF-8.

    redis-py encodes every ``str`` argument with the client's ``encoding``, and idemq reads what
    it stored back as UTF-8 (:func:`text`): under another encoding, a record or key holding a
    non-ASCII character would be written in one encoding and read in another.
    """
    encoding = client.connection_pool.connection_kwargs.get("encoding", "utf-8")
    if codecs.lookup(encoding).name != "utf-8":
        raise ConfigurationError(f"{user} needs a client with encoding='utf-8', got {encoding!r}")


def _action(step: Step) -> str:
    """What ``step`` does, for an error message."""
    if isinstance(step, RunScript):
        return step.script.name
    if isinstance(step, Call):
        return step.method.upper()
    if isinstance(step, Batch):
        return f"pipeline of {len(step.calls)}"
    return type(step).__name__


class _Executor(Generic[C]):
    """What both executors hold: the client, its safe name and its registered scripts."""

    def __init__(self, client: C) -> None:
        self.client: C = client
        self.server = describe_server(client.connection_pool.connection_kwargs)
        self._scripts: dict[LuaScript, Any] = {}

    def _registered(self, script: LuaScript) -> Any:
        # One redis-py Script per script and client, registered on first use. A race between
        # two threads registers it twice, which is harmless: both objects name the same SHA.
        registered = self._scripts.get(script)
        if registered is None:
            registered = self._scripts[script] = self.client.register_script(script.source)
        return registered

    def _failed(self, step: Step, exc: rx.RedisError) -> StoreError:
        return translate_error(exc, _action(step), self.server)

    def _refuse(self, step: Step) -> TypeError:
        return TypeError(f"{type(self).__name__} cannot execute {step!r}")


class RedisExecutor(_Executor[redis.Redis]):
    """Carries out the :data:`Step` values of a plan on a sync client (see the module)."""

    def __call__(self, step: Step) -> Any:
        """The reply of ``step``; a redis-py failure raised as its idemq error."""
        try:
            if isinstance(step, RunScript):
                return self._registered(step.script)(keys=step.keys, args=step.args)
            if isinstance(step, Call):
                return step.run_on(self.client)
            if isinstance(step, Batch):
                with self.client.pipeline(transaction=False) as pipe:
                    for call in step.calls:
                        call.run_on(pipe)
                    return pipe.execute()
        except rx.RedisError as exc:
            raise self._failed(step, exc) from exc
        raise self._refuse(step)


class AsyncRedisExecutor(_Executor[redis.asyncio.Redis]):
    """:class:`RedisExecutor` for a ``redis.asyncio`` client: the same steps, awaited."""

    async def __call__(self, step: Step) -> Any:
        """See :meth:`RedisExecutor.__call__`."""
        try:
            if isinstance(step, RunScript):
                return await self._registered(step.script)(keys=step.keys, args=step.args)
            if isinstance(step, Call):
                return await step.run_on(self.client)
            if isinstance(step, Batch):
                pipe: Any  # redis-py leaves the async pipeline untyped
                async with self.client.pipeline(transaction=False) as pipe:
                    for call in step.calls:
                        call.run_on(pipe)
                    return await pipe.execute()
        except rx.RedisError as exc:
            raise self._failed(step, exc) from exc
        raise self._refuse(step)
