"""The redis-py boundary: clients from URLs, Lua script steps and their executors, errors.

Everything idemq does on Redis (the store, the lock, node leases, id reservations) is written
once as a plan: a generator that yields :data:`Step` values (run a Lua script, call a command,
send a pipeline, pause) and receives their replies (:mod:`idemq._plan`). A
:class:`RedisExecutor` or :class:`AsyncRedisExecutor` carries the steps out, so the sync and
async shells of each object differ only in which executor they hold, and the logic of a claim,
a SCAN loop or a blocking lock acquire cannot drift between them.

The executors go through redis-py's public doors only: a script is an ``EVALSHA`` sent with
``execute_command`` (when the server answers NOSCRIPT after a restart, a ``SCRIPT FLUSH`` or a
failover, the same call goes again as ``EVAL`` with the source, which also puts the script
back in the server's cache), a command is the client method of that name, and redis-py
encodes every argument and parses every reply.

Redis Cluster: a ``redis://…?cluster=true`` URL builds a ``redis.cluster.RedisCluster`` (or its
asyncio twin), and one passed in is used as it is. redis-py follows ``MOVED``/``ASK`` replies
and refreshes its slot map itself; what it gives up on (``CLUSTERDOWN``, ``TRYAGAIN``, a slot
no master serves during a failover) is :class:`~idemq.errors.StoreUnavailableError`. A script
touches keys of one slot only, so a plan over many keys groups them with :func:`key_slot`;
SCAN runs on each master in turn (:class:`Primaries`, :class:`ScanPage`).

Errors: a redis-py exception is translated here, once, into
:class:`~idemq.errors.StoreUnavailableError` (cannot reach / timed out / failover in progress)
or :class:`~idemq.errors.StoreError` (anything else), always ``from exc``. Messages name the
server as ``host:port/db``, never the URL, so a password in it cannot leak into a log.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import re
import ssl
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeAlias, TypeVar, overload
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis import exceptions as rx
from redis.crc import key_slot as _crc_key_slot

from idemq.drivers.urls import is_redis_url, mask_url
from idemq.errors import (
    ConfigurationError,
    StoreConfigurationError,
    StoreError,
    StoreUnavailableError,
)

__all__ = [
    "DEFAULT_SOCKET_TIMEOUT_S",
    "EXTEND_IF_OWNER",
    "AnyAsyncRedis",
    "AnyRedis",
    "AsyncRedisExecutor",
    "Batch",
    "Call",
    "LuaScript",
    "Op",
    "Pause",
    "Primaries",
    "RedisExecutor",
    "RunScript",
    "ScanPage",
    "Step",
    "describe_client",
    "escape_key_part",
    "group_by_slot",
    "is_cluster",
    "key_slot",
    "redis_client",
    "require_utf8",
    "text",
    "translate_error",
    "unescape_key_part",
]

T = TypeVar("T")
AnyRedis: TypeAlias = redis.Redis | redis.cluster.RedisCluster
"""A sync client idemq works with: one server (or a Sentinel-made client) or a Cluster."""
AnyAsyncRedis: TypeAlias = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster
"""The asyncio twin of :data:`AnyRedis`."""
C = TypeVar("C", AnyRedis, AnyAsyncRedis)


@dataclass(frozen=True, slots=True)
class LuaScript:
    """A Lua script's source, its name (for error messages) and its SHA1 (its ``EVALSHA``
    name, computed once here rather than per call)."""

    name: str
    source: str
    sha: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The documented way to set a derived field of a frozen dataclass.
        sha = hashlib.sha1(self.source.encode("utf-8"), usedforsecurity=False).hexdigest()
        object.__setattr__(self, "sha", sha)


class RunScript(NamedTuple):
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


@dataclass(frozen=True, slots=True)
class Primaries:
    """The names of the masters a SCAN must visit: ``[""]`` (the one server) for a plain
    client, every master's ``host:port`` for a Cluster client (redis-py's slot map)."""


@dataclass(frozen=True, slots=True)
class ScanPage:
    """One ``SCAN cursor MATCH match COUNT count TYPE type_`` on master ``node`` (a name from
    :class:`Primaries`); the reply is ``(next_cursor, keys)``, ``next_cursor`` 0 at the end."""

    node: str
    cursor: int
    match: str
    count: int
    type_: str


Step = RunScript | Call | Batch | Pause | Primaries | ScanPage
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


_KEY_SAFE = re.compile(r"[A-Za-z0-9_.~-]*")
"""The characters ``quote`` never escapes."""
_ASCII_ESCAPES = {code: f"%{code:02X}" for code in range(128) if not _KEY_SAFE.fullmatch(chr(code))}
"""``quote``'s escape of every other ASCII character, for ``str.translate``."""


def escape_key_part(value: str) -> str:
    """``value`` percent-encoded for a key: only ``[A-Za-z0-9_.~-]`` and ``%XX`` remain.

    Names and ids are arbitrary text. A raw ``}`` would end a Cluster hash tag early, a raw
    ``:`` would make two different pairs of parts one key, and a raw ``*``/``?``/``[`` would
    turn a SCAN pattern into a wildcard. ``surrogatepass`` gives even a lone surrogate a key.
    A value made of those characters already (most ids) is its own escape.
    """
    if _KEY_SAFE.fullmatch(value):
        return value
    if value.isascii():  # what quote would write, without its bytes round trip
        return value.translate(_ASCII_ESCAPES)
    return quote(value, safe="", encoding="utf-8", errors="surrogatepass")


def unescape_key_part(value: str) -> str:
    """The text :func:`escape_key_part` encoded."""
    return unquote(value, encoding="utf-8", errors="surrogatepass")


def key_slot(key: str) -> int:
    """The Cluster hash slot of ``key`` (CRC16 of its hash tag, as the server computes it)."""
    return int(_crc_key_slot(key.encode("utf-8", "surrogatepass")))


def group_by_slot(keys: Sequence[str]) -> list[list[int]]:
    """The positions of ``keys`` grouped by hash slot, each group in the order of ``keys``,
    the groups in the order of their first key: one script call per group."""
    groups: dict[int, list[int]] = {}
    for position, key in enumerate(keys):
        groups.setdefault(key_slot(key), []).append(position)
    return list(groups.values())


def is_cluster(client: AnyRedis | AnyAsyncRedis) -> bool:
    """Whether ``client`` talks to a Redis Cluster."""
    return isinstance(client, redis.cluster.RedisCluster | redis.asyncio.cluster.RedisCluster)


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


# redis-py's Cluster errors that mean "retry later", whatever their message says.
_CLUSTER_UNAVAILABLE = (
    rx.ClusterDownError,  # CLUSTERDOWN, MASTERDOWN
    rx.TryAgainError,  # TRYAGAIN: a slot migrating
    rx.AskError,  # MOVED and ASK that redis-py stopped following
    rx.ClusterError,  # "TTL exhausted": the slot map kept changing under redis-py
    rx.SlotNotCoveredError,  # no master serves the slot right now
)


def translate_error(
    exc: rx.RedisError | rx.RedisClusterException, action: str, server: str
) -> StoreError:
    """The idemq error for a redis-py failure of ``action`` on ``server``; raise it ``from exc``."""
    reason = f"{type(exc).__name__}: {exc}"
    if _certificate_refused(exc):
        # Checked before ConnectionError, which redis-py wraps it in: the same CA refuses the
        # same certificate on every retry, so this is the setup to fix, not an outage to wait out.
        return StoreConfigurationError(
            f"redis {server} refused during {action}: its TLS certificate is not trusted"
            f" (check ssl_ca_certs in the rediss:// URL) ({reason})"
        )
    if isinstance(exc, rx.ConnectionError | rx.TimeoutError):  # BusyLoadingError included
        return StoreUnavailableError(f"redis {server} unavailable during {action} ({reason})")
    if isinstance(exc, rx.AskError):
        # A Cluster client follows MOVED/ASK itself; one that reaches here came to a plain
        # client connected to one node of a cluster.
        return StoreUnavailableError(
            f"redis {server} redirected {action} ({reason}): it is a Redis Cluster node, "
            "connect with a ?cluster=true URL or a RedisCluster client"
        )
    if isinstance(exc, _CLUSTER_UNAVAILABLE) or (
        isinstance(exc, rx.RedisClusterException)
        and isinstance(exc.__cause__ or exc.__context__, rx.ConnectionError | rx.TimeoutError)
    ):
        # A failover in progress: redis-py gave up following MOVED/ASK, or the slot's master
        # is gone and no replica has been promoted yet. The command did not run.
        return StoreUnavailableError(f"redis {server} not serving {action} ({reason})")
    if isinstance(exc, rx.ResponseError) and str(exc).startswith(_UNAVAILABLE_REPLIES):
        return StoreUnavailableError(f"redis {server} not serving {action} ({reason})")
    if isinstance(exc, rx.ResponseError) and str(exc).startswith("syntax error"):
        # idemq's commands are fixed; a server that cannot parse them is too old (SET … NX GET).
        return StoreError(f"redis {server} rejected {action} ({reason}): idemq needs Redis >= 7.0")
    return StoreError(f"redis {server} failed {action} ({reason})")


def _certificate_refused(exc: BaseException) -> bool:
    """Whether the TLS handshake failed because the client did not trust the server's
    certificate (an unknown CA, another host name), anywhere in ``exc``'s chain of causes."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        if isinstance(error, ssl.SSLCertVerificationError):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def describe_client(client: AnyRedis | AnyAsyncRedis) -> str:
    """``host:port/db`` (or the socket path) of a client, ``cluster host:port`` for a
    Cluster client (the node it was started from), never a password."""
    if isinstance(client, redis.cluster.RedisCluster | redis.asyncio.cluster.RedisCluster):
        node = client.get_default_node()  # None for an asyncio client not connected yet
        return "cluster" if node is None else f"cluster {node.host}:{node.port}"
    connection_kwargs = client.get_connection_kwargs()
    if connection_kwargs.get("path"):
        return f"unix:{connection_kwargs['path']}/{connection_kwargs.get('db', 0)}"
    host = connection_kwargs.get("host", "localhost")
    port = connection_kwargs.get("port", 6379)
    return f"{host}:{port}/{connection_kwargs.get('db', 0)}"


DEFAULT_SOCKET_TIMEOUT_S = 5.0
"""For clients idemq builds from a URL: a hung server becomes StoreUnavailableError, not a hang."""

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no", "")


def _cluster_url(url: str) -> tuple[str, bool]:
    """``url`` without its ``cluster`` query argument, and whether it asked for a Cluster."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    values = [value.lower() for name, value in query if name == "cluster"]
    if not values:
        return url, False
    if len(values) > 1 or values[0] not in _TRUE + _FALSE:
        raise ConfigurationError(f"cluster must be true or false in {mask_url(url)}")
    rest = urlencode([(name, value) for name, value in query if name != "cluster"])
    # Cut by hand, not urlunsplit: it writes ``unix:///path`` (no host) back as ``unix:/path``,
    # which redis-py refuses.
    base = url.partition("?")[0].partition("#")[0]
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    return f"{base}?{rest}{fragment}" if rest else f"{base}{fragment}", values[0] in _TRUE


@overload
def redis_client(
    client_or_url: AnyRedis | str,
    kind: type[redis.Redis],
    *,
    socket_timeout_s: float = ...,
) -> AnyRedis: ...


@overload
def redis_client(
    client_or_url: AnyAsyncRedis | str,
    kind: type[redis.asyncio.Redis],
    *,
    socket_timeout_s: float = ...,
) -> AnyAsyncRedis: ...


def redis_client(
    client_or_url: AnyRedis | AnyAsyncRedis | str,
    kind: type[redis.Redis] | type[redis.asyncio.Redis],
    *,
    socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
) -> AnyRedis | AnyAsyncRedis:
    """A redis-py client of ``kind`` (``redis.Redis`` or ``redis.asyncio.Redis``) or of its
    Cluster twin: ``client_or_url`` itself when it is one, else one built from a ``redis://``,
    ``rediss://`` or ``unix://`` URL with ``socket_timeout_s`` for connecting and for every
    reply (the caller owns and closes a client built here). ``?cluster=true`` in the URL builds
    a Cluster client, the URL's host being any node of the cluster. Raises
    :class:`~idemq.ConfigurationError` for anything else, and
    :class:`~idemq.StoreUnavailableError` when no node of a Cluster answers (a sync Cluster
    client reads the slot map when it is built)."""
    cluster_kind = redis.cluster.RedisCluster if kind is redis.Redis else _ASYNC_CLUSTER
    if isinstance(client_or_url, kind | cluster_kind):
        return client_or_url
    if not isinstance(client_or_url, str):
        raise ConfigurationError(
            f"needs a {kind.__module__}.{kind.__name__}, a {cluster_kind.__module__}."
            f"{cluster_kind.__name__} or a Redis URL, got {type(client_or_url).__name__}"
        )
    if not is_redis_url(client_or_url):
        raise ConfigurationError(
            f"not a Redis URL (redis://, rediss:// or unix://): {mask_url(client_or_url)}"
        )
    url, cluster = _cluster_url(client_or_url)
    _check_tls_files(url)
    if cluster and urlsplit(url).scheme.lower() == "unix":
        raise ConfigurationError(f"a Cluster is reached over TCP: {mask_url(url)}")
    try:
        if cluster:
            return cluster_kind.from_url(
                url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
            )
        return kind.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
        )
    except ValueError as exc:
        raise ConfigurationError(f"invalid Redis URL {mask_url(url)}: {exc}") from exc
    except (rx.RedisError, rx.RedisClusterException) as exc:
        raise StoreUnavailableError(
            f"redis cluster at {mask_url(url)} unreachable ({type(exc).__name__}: {exc})"
        ) from exc


_ASYNC_CLUSTER = redis.asyncio.cluster.RedisCluster

# redis-py's URL options naming files of the TLS setup.
_TLS_FILE_OPTIONS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")


def _check_tls_files(url: str) -> None:
    """:class:`~idemq.ConfigurationError` when a TLS option of ``url`` names no file.

    redis-py opens them at the first connection and reports a missing one as a connection error
    ("No such file or directory"): an outage to a worker, which would retry it forever.
    """
    for name, value in parse_qsl(urlsplit(url).query):
        if name in _TLS_FILE_OPTIONS and not os.path.exists(value):
            raise ConfigurationError(f"{name} names no file: {value} (in {mask_url(url)})")


def require_utf8(client: AnyRedis | AnyAsyncRedis, user: str) -> None:
    """Refuse a client that would encode idemq's text other than as UTF-8.

    redis-py encodes every ``str`` argument with the client's ``encoding``, and idemq reads what
    it stored back as UTF-8 (:func:`text`): under another encoding, a record or key holding a
    non-ASCII character would be written in one encoding and read in another.
    """
    encoding = client.get_encoder().encoding
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
    if isinstance(step, ScanPage):
        return f"SCAN on {step.node}" if step.node else "SCAN"
    return type(step).__name__


class _Executor(Generic[C]):
    """What both executors hold: the client and its safe name."""

    def __init__(self, client: C) -> None:
        self.client: C = client
        self.cluster = is_cluster(client)
        self.server = describe_client(client)

    def _scan_kwargs(self, step: ScanPage) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"match": step.match, "count": step.count, "_type": step.type_}
        if isinstance(self.client, redis.cluster.RedisCluster | _ASYNC_CLUSTER):
            cluster: Any = self.client  # redis-py leaves the sync Cluster's node lookups untyped
            node = cluster.get_node(node_name=step.node)
            if node is None:  # the master left the slot map (failover) since Primaries
                raise rx.SlotNotCoveredError(f"master {step.node} is no longer in the cluster")
            kwargs["target_nodes"] = node
        return kwargs

    def _scan_reply(self, step: ScanPage, reply: Any) -> tuple[int, list[Any]]:
        cursor, keys = reply
        if self.cluster:  # redis-py keys a Cluster SCAN's cursors by node name
            cursor = cursor[step.node]
        return int(cursor), list(keys)

    def _primaries(self) -> list[str]:
        if not isinstance(self.client, redis.cluster.RedisCluster | _ASYNC_CLUSTER):
            return [""]
        cluster: Any = self.client  # untyped in redis-py, as above
        return sorted(node.name for node in cluster.get_primaries())

    def _failed(self, step: Step, exc: rx.RedisError | rx.RedisClusterException) -> StoreError:
        return translate_error(exc, _action(step), self.server)

    def _refuse(self, step: Step) -> TypeError:
        return TypeError(f"{type(self).__name__} cannot execute {step!r}")


class RedisExecutor(_Executor[AnyRedis]):
    """Carries out the :data:`Step` values of a plan on a sync client (see the module)."""

    def __call__(self, step: Step) -> Any:
        """The reply of ``step``; a redis-py failure raised as its idemq error."""
        try:
            if isinstance(step, RunScript):
                # numkeys then the keys: a Cluster client routes EVALSHA by its keys' slot.
                arguments = (len(step.keys), *step.keys, *step.args)
                client: Any = self.client  # redis-py leaves the sync execute_command untyped
                try:
                    return client.execute_command("EVALSHA", step.script.sha, *arguments)
                except rx.NoScriptError:
                    # The server's script cache is empty (a restart, SCRIPT FLUSH, a failover to a
                    # replica that never ran it): EVAL runs the source and caches it again, so the
                    # message is not failed and the next call is an EVALSHA again.
                    return client.execute_command("EVAL", step.script.source, *arguments)
            if isinstance(step, Call):
                return step.run_on(self.client)
            if isinstance(step, Batch):
                with self.client.pipeline(transaction=False) as pipe:
                    for call in step.calls:
                        call.run_on(pipe)
                    return pipe.execute()
            if isinstance(step, ScanPage):
                reply = self.client.scan(step.cursor, **self._scan_kwargs(step))
                return self._scan_reply(step, reply)
            if isinstance(step, Primaries):
                return self._primaries()
        except (rx.RedisError, rx.RedisClusterException) as exc:
            raise self._failed(step, exc) from exc
        raise self._refuse(step)


class AsyncRedisExecutor(_Executor[AnyAsyncRedis]):
    """:class:`RedisExecutor` for a ``redis.asyncio`` client: the same steps, awaited."""

    async def __call__(self, step: Step) -> Any:
        """See :meth:`RedisExecutor.__call__`."""
        try:
            if isinstance(step, RunScript):
                arguments = (len(step.keys), *step.keys, *step.args)  # see RedisExecutor
                try:
                    return await self.client.execute_command("EVALSHA", step.script.sha, *arguments)
                except rx.NoScriptError:
                    return await self.client.execute_command("EVAL", step.script.source, *arguments)
            if isinstance(step, Call):
                return await step.run_on(self.client)
            if isinstance(step, Batch):
                pipe: Any  # redis-py leaves the async pipeline untyped
                async with self.client.pipeline(transaction=False) as pipe:
                    for call in step.calls:
                        call.run_on(pipe)
                    return await pipe.execute()
            if isinstance(step, ScanPage):
                reply = await self.client.scan(step.cursor, **self._scan_kwargs(step))
                return self._scan_reply(step, reply)
            if isinstance(step, Primaries):
                if isinstance(self.client, _ASYNC_CLUSTER):
                    await self.client.initialize()  # an asyncio Cluster reads its map lazily
                return self._primaries()
        except (rx.RedisError, rx.RedisClusterException) as exc:
            raise self._failed(step, exc) from exc
        raise self._refuse(step)
