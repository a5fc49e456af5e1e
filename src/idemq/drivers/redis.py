"""Sans-I/O plumbing shared by every Redis-backed object (stores and locks), sync and async.

Each operation is written **once** as a generator that yields :data:`Step` values (run a Lua
script, send a command, send a pipeline, pause) and receives the replies. The sync and async
shells only *execute* steps — :func:`drive` and :func:`adrive` feed the replies back — so the
logic of a SCAN loop or a blocking lock acquire cannot drift between the two twins.

Errors: redis-py exceptions are translated here, at the boundary, into
:class:`~idemq.errors.StoreUnavailableError` (cannot reach / timed out / failover in progress)
or :class:`~idemq.errors.StoreError` (anything else), always ``from exc``. Messages name the
server as ``host:port/db`` — never the URL, so a password in it cannot leak into a log.
"""

from __future__ import annotations

import hashlib
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

import redis
from redis import exceptions as rx

from idemq.errors import ConfigurationError, StoreError, StoreUnavailableError

__all__ = [
    "Batch",
    "Call",
    "LuaScript",
    "Op",
    "Pause",
    "RunScript",
    "Step",
    "describe_server",
    "evalsha_argv",
    "redact_url",
    "text",
    "translate_error",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LuaScript:
    """A Lua script's source, its name (for error messages) and its SHA-1 (for EVALSHA)."""

    name: str
    source: str
    sha: bytes = field(init=False)
    """The hex digest EVALSHA names the script by, as ASCII bytes (sent as is, see
    :func:`evalsha_argv`); redis-py's ``Script`` hashes the same UTF-8 bytes."""

    def __post_init__(self) -> None:
        digest = hashlib.sha1(self.source.encode(), usedforsecurity=False).hexdigest()
        object.__setattr__(self, "sha", digest.encode())


class RunScript(NamedTuple):
    """Run a :class:`LuaScript` (one round trip); the reply is the script's return.

    A named tuple, not a dataclass: the store builds one per claim, and a tuple is built in a
    third of the time.
    """

    script: LuaScript
    keys: Sequence[str | bytes]
    args: Sequence[str | bytes | int]


@dataclass(frozen=True, slots=True)
class Call:
    """One plain command, e.g. ``("SCAN", 0, "MATCH", pattern)``; replies parsed by redis-py."""

    args: tuple[str | bytes | int, ...]


@dataclass(frozen=True, slots=True)
class Batch:
    """Several commands in one pipelined round trip (no MULTI: each reply is independent)."""

    calls: tuple[tuple[str | bytes | int, ...], ...]


@dataclass(frozen=True, slots=True)
class Pause:
    """Wait ``seconds`` (only the lock uses it: polling, renewal); the reply is ``True`` when the
    wait was cut short because the owner asked to stop, else ``False``."""

    seconds: float


def evalsha_argv(call: RunScript) -> tuple[str | bytes | int, ...]:
    """The EVALSHA command line of ``call``, for ``client.execute_command(*argv)``.

    Sent directly rather than through redis-py's ``Script`` wrapper, whose per-call copying and
    dispatch cost as much as parsing a duplicate's reply. The caller loads the script on
    ``NoScriptError`` and repeats the call. The constant words are bytes because redis-py's
    encoder passes bytes through at its first type test (a ``str`` or ``int`` takes five).
    """
    return (_EVALSHA, call.script.sha, b"%d" % len(call.keys), *call.keys, *call.args)


_EVALSHA = b"EVALSHA"


Step = RunScript | Call | Batch | Pause
Op = Generator[Step, Any, T]
"""An operation: yields steps, receives each step's reply, returns its result."""


def text(value: bytes | str) -> str:
    """A reply value as ``str`` whether the client decodes responses or not.

    ``surrogatepass`` mirrors how idemq encodes what it writes, so any ``str`` round-trips.
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
        return StoreError(
            f"redis {server} rejected {action} ({reason}): RedisStore needs Redis >= 7.0"
        )
    return StoreError(f"redis {server} failed {action} ({reason})")


def describe_server(connection_kwargs: Mapping[str, Any]) -> str:
    """``host:port/db`` (or the socket path) of a client — never its password."""
    if connection_kwargs.get("path"):
        return f"unix:{connection_kwargs['path']}/{connection_kwargs.get('db', 0)}"
    host = connection_kwargs.get("host", "localhost")
    port = connection_kwargs.get("port", 6379)
    return f"{host}:{port}/{connection_kwargs.get('db', 0)}"


def redact_url(url: str) -> str:
    """``url`` with any user and password replaced by ``***`` (for error messages)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable redis URL>"
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"***@{host}").geturl()


def check_url(url: str) -> None:
    """Raise :class:`ConfigurationError` unless ``url`` looks like a Redis URL."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in {"redis", "rediss", "unix"}:
        raise ConfigurationError(
            f"not a Redis URL (redis://, rediss:// or unix://): {redact_url(url)}"
        )


def redis_client(client_or_url: Any) -> redis.Redis:
    """A redis-py client from a client (returned as is) or a ``redis://`` URL."""
    if isinstance(client_or_url, str):
        if redis is None:  # pragma: no cover - depends on the installed extras
            raise ConfigurationError("Redis support needs the 'redis' extra")
        return redis.Redis.from_url(client_or_url)
    return client_or_url  # type: ignore[no-any-return]
