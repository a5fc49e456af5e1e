"""``IdempotencyKeyMiddleware``: the HTTP ``Idempotency-Key`` header for any ASGI app
(Starlette, FastAPI, …), on idemq's async guard and stores.

A pure ASGI middleware, like Starlette's own: it wraps ``receive`` and ``send``, lets websocket
and lifespan scopes and unguarded methods through untouched, and buffers only what it must
store — the body of a guarded request (for its fingerprint) and of its response (for replay).

One guarded request::

    key     Idempotency-Key header (or key=callable(scope, body)) → dedup id in the client's scope
    lock    PostgreSQL, transactional: the key's in-flight lock (:mod:`._inflight`); taken by a
            first request still running → 409 (or tried again up to ``wait_s``)
    claim   the guard claims the id (AsyncIdempotency.process), with the request's fingerprint
    run     the app runs with the response captured; a transactional store's connection is in
            scope["state"]["idemq_tx"], so the app's writes join the dedup row's transaction
    store   a stored status → the response is the guard's result, committed with the effect,
            then sent; any other status (5xx) → the handler fails on purpose: the transaction
            rolls back (lease mode: the claim is released) and the response is sent unstored
    again   same key, same fingerprint → the stored response, ``Idempotent-Replayed: true``;
            another fingerprint → 422; still running → 409 (or wait up to ``wait_s``)

The rules themselves (key syntax, scoping, fingerprint, header filter, problem bodies) are in
:mod:`idemq.integrations.http`, shared with the Django middleware.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from idemq._clock import Clock
from idemq.drivers.sql import translate_db_error, translated
from idemq.errors import (
    ConfigurationError,
    InvalidMessageIdError,
    LeaseLostError,
    PayloadMismatchError,
    StoreConflictError,
    StoreError,
)
from idemq.guard.core import Mode, Outcome, Status
from idemq.guard.idempotency_async import AsyncIdempotency
from idemq.guard.probes import Observer
from idemq.integrations._asgi import (
    TX_STATE_KEY,
    ASGIApp,
    Capture,
    Receive,
    Scope,
    Send,
    app_scope,
    maybe_await,
    replaying,
    respond,
)
from idemq.integrations._inflight import lock_pauses, try_lock_sql
from idemq.integrations.http import (
    DEFAULT_METHODS,
    KEY_HEADER,
    MAX_KEY_CHARS,
    Problem,
    StoredResponse,
    check_key,
    dedup_id,
    parse_key,
    request_fingerprint,
    scope_token,
)
from idemq.integrations.http import stored_statuses as _stored_statuses
from idemq.stores.base import AsyncStore, AsyncTransactionalStore
from idemq.stores.sql.store_async import AsyncSqlStore

__all__ = ["TX_STATE_KEY", "IdempotencyKeyMiddleware"]

log = logging.getLogger("idemq.http")

ScopeFn = Callable[[Scope], "str | Awaitable[str | None] | None"]
KeyFn = Callable[[Scope, bytes], "str | Awaitable[str | None] | None"]


class _NotStored(Exception):
    """Raised by the guarded handler for a response that is not stored, so the guard rolls
    back its transaction (or releases its claim): what is not stored did not happen."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.headers = headers
        self.body = body


class IdempotencyKeyMiddleware:
    """Guard an ASGI app's ``POST``/``PATCH`` requests with the ``Idempotency-Key`` header.

    ``store``: an async store (:class:`~idemq.AsyncSqlStore`, :class:`~idemq.AsyncRedisStore`).
    In transactional mode (a SQL store's default) the dedup row, the stored response and the
    app's own writes through ``scope["state"]["idemq_tx"]`` commit together or not at all; in
    lease mode (Redis, or ``mode="lease"``) the effect is elsewhere and a response that is
    not stored releases the claim.

    Options:

    * ``required`` — a guarded request without a key gets 400 (else it passes unguarded);
    * ``methods`` — the guarded methods; any other passes through untouched;
    * ``scope`` — ``callable(asgi_scope) -> str | None`` naming the client a key belongs to (a
      user or session id); ``None`` (default): a digest of the ``Authorization`` header, or the
      whole app for requests without one. Apps with cookie sessions must pass it;
    * ``key`` — ``callable(asgi_scope, body) -> str | None`` reading the key from the request
      instead of the header (a webhook's event id); may be async;
    * ``wait_s`` — how long a request whose key is still running waits for it to finish and
      replays its response, instead of answering 409 at once; ``None``: as long as it runs
      (transactional: on its row lock, as the database's own lock timeout allows, with no
      statement of the middleware's own; lease: up to ``lease_s``);
    * ``consumer`` — the dedup records' consumer name (keeps these keys apart from others);
    * ``mode``, ``lease_s``, ``clock``, ``observer`` — passed to the guard;
    * ``stored_statuses`` — the statuses whose responses are stored (default:
      :data:`~idemq.integrations.http.DEFAULT_STORED_STATUSES`); no 5xx;
    * ``max_key_chars`` — the longest key accepted (at most 95);
    * ``max_request_bytes`` — the largest guarded request body (413 past it);
    * ``max_response_bytes`` — the largest response stored; a larger one is not stored, its
      transaction rolls back (lease: its claim is released) and the client gets a 500 problem:
      a success that could not be recorded is never reported;
    * ``problem_type_base`` — a URI the problems' ``type`` is made from (``base + code``);
      default ``about:blank``.

    The retention of keys is the store's: ``expires_after_s`` on the store, or ``idemq purge``.
    """

    def __init__(
        self,
        app: ASGIApp,
        store: AsyncStore,
        *,
        required: bool = False,
        methods: Iterable[str] = DEFAULT_METHODS,
        scope: ScopeFn | None = None,
        key: KeyFn | None = None,
        wait_s: float | None = 0,
        consumer: str = "http",
        mode: str | None = None,
        lease_s: float = 30.0,
        stored_statuses: Iterable[int] | None = None,
        max_key_chars: int = MAX_KEY_CHARS,
        max_request_bytes: int = 1024 * 1024,
        max_response_bytes: int = 1024 * 1024,
        problem_type_base: str | None = None,
        clock: Clock | None = None,
        observer: Observer | None = None,
    ) -> None:
        # A protocol check only compares method names, and the sync stores have the same ones.
        if not isinstance(store, AsyncStore) or not inspect.iscoroutinefunction(store.claim):
            raise ConfigurationError(
                f"IdempotencyKeyMiddleware needs an async store (AsyncSqlStore, "
                f"AsyncRedisStore), got {type(store).__name__}"
            )
        if not 0 < max_key_chars <= MAX_KEY_CHARS:
            raise ConfigurationError(f"max_key_chars must be 1-{MAX_KEY_CHARS}")
        if wait_s is not None and not wait_s >= 0:
            raise ConfigurationError(f"wait_s must be >= 0 or None, got {wait_s!r}")
        if max_request_bytes <= 0 or max_response_bytes <= 0:
            raise ConfigurationError("max_request_bytes and max_response_bytes must be positive")
        self.app = app
        self.store = store
        transactional = isinstance(store, AsyncTransactionalStore) and mode != Mode.LEASE
        # In transactional mode a retry waits on the first request's row lock, not by polling:
        # the guard's wait_s is a lease-mode option, the lock timeout below stands for it.
        lease_wait_s = lease_s if wait_s is None else wait_s
        self.guard = AsyncIdempotency(
            store,
            consumer=consumer,
            mode=mode,
            lease_s=lease_s,
            wait_s=0 if transactional else lease_wait_s,
            clock=clock,
            observer=observer,
        )
        self.required = required
        self.methods = frozenset(m.upper() for m in methods)
        self.scope_fn = scope
        self.key_fn = key
        # Transactional with a bounded wait: the middleware opens the connection (PostgreSQL:
        # and tries the key's in-flight lock on it) and the guard's transaction is its own, so
        # a key in flight or a deadlock is this request's 409, not a transaction the guard reruns.
        self.owns_connection = (
            self.guard.mode is Mode.TRANSACTIONAL
            and wait_s is not None
            and isinstance(store, AsyncSqlStore)
        )
        self.wait_s = wait_s or 0.0
        self.stored_statuses = _stored_statuses(stored_statuses)
        self.max_key_chars = max_key_chars
        self.max_request_bytes = max_request_bytes
        self.max_response_bytes = max_response_bytes
        self.problem_type_base = problem_type_base

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.methods:
            await self.app(scope, receive, send)
            return
        if self.key_fn is None:
            # The key is in the header: a request without one passes with its body unread
            # (streamed to the app as it comes), and a bad one is refused before reading it.
            try:
                key = self._header_key(scope)
            except InvalidMessageIdError as exc:
                await self._problem(send, Problem.invalid_key(str(exc)))
                return
            if key is None:
                await self._unguarded(scope, receive, send)
                return
            body = await self._body(receive, send)
            if body is None:
                return
        else:
            body = await self._body(receive, send)
            if body is None:
                return
            try:
                key = await self._callable_key(scope, body)
            except InvalidMessageIdError as exc:
                await self._problem(send, Problem.invalid_key(str(exc)))
                return
            if key is None:
                await self._unguarded(scope, replaying(body, receive), send)
                return
        token = scope_token(await self._scope_value(scope))
        fingerprint = request_fingerprint(
            scope["method"],
            scope.get("root_path", "") + scope["path"],
            scope.get("query_string", b""),
            body,
        )
        replay = replaying(body, receive)
        await self._guarded(scope, replay, send, dedup_id(token, key), fingerprint)

    async def _unguarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request of a guarded method without a key: 400 when one is required."""
        if self.required:
            await self._problem(send, Problem.missing_key())
        else:
            await self.app(scope, receive, send)

    # -- the request ------------------------------------------------------------------------

    async def _body(self, receive: Receive, send: Send) -> bytes | None:
        """The whole request body; None when it was answered (413: past the limit, where
        reading stops) or the client left before sending it all."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                await self._problem(send, Problem.request_too_large(self.max_request_bytes))
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _header_key(self, scope: Scope) -> str | None:
        """The ``Idempotency-Key`` header's key (checked), or None without the header."""
        raw = [value for name, value in scope.get("headers", ()) if name.lower() == KEY_HEADER]
        if not raw:
            return None
        if len(raw) > 1:
            raise InvalidMessageIdError("the request has more than one Idempotency-Key header")
        return check_key(parse_key(raw[0]), self.max_key_chars)

    async def _callable_key(self, scope: Scope, body: bytes) -> str | None:
        """The key that ``key=`` reads from the request (checked), or None."""
        assert self.key_fn is not None
        try:
            found = await maybe_await(self.key_fn(scope, body))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidMessageIdError(f"the request's key could not be read: {exc}") from exc
        if found is None:
            return None
        if not isinstance(found, str):
            raise InvalidMessageIdError(f"key= returned {type(found).__name__}, not str")
        return check_key(found, self.max_key_chars)

    async def _scope_value(self, scope: Scope) -> str | bytes | None:
        if self.scope_fn is not None:
            value: str | bytes | None = await maybe_await(self.scope_fn(scope))
            return value
        for name, credentials in scope.get("headers", ()):
            if name.lower() == b"authorization":
                return bytes(credentials)
        return None

    # -- the guard --------------------------------------------------------------------------

    async def _guarded(
        self, scope: Scope, receive: Receive, send: Send, message_id: str, fingerprint: str
    ) -> None:
        capture = Capture(self.max_response_bytes)

        async def handler(tx: Any) -> dict[str, Any]:
            await self.app(app_scope(scope, tx), receive, capture.send)
            return self._judge(capture)

        outcome: Outcome[dict[str, Any]]
        try:
            if self.owns_connection:
                outcome = await self._on_own_connection(message_id, handler, fingerprint)
            else:
                outcome = await self.guard.process(message_id, handler, payload=fingerprint)
        except _NotStored as response:
            await respond(send, response.status, response.headers, response.body)
            return
        except PayloadMismatchError:
            await self._problem(send, Problem.reused())
            return
        except (StoreConflictError, LeaseLostError):
            # Transactional: a deadlock rolled this one back, or (a database without the
            # in-flight lock) the first request's row lock outlasted the server's lock
            # timeout: nothing was written, a retry is safe.
            await self._problem(send, Problem.in_flight())
            return
        except StoreError:
            log.warning("idempotency store failed for %s", message_id, exc_info=True)
            await self._problem(send, Problem.store_unavailable())
            return
        if outcome.status is Status.PROCESSED:
            assert capture.status is not None
            await respond(send, capture.status, capture.headers, capture.joined())
        elif outcome.status is Status.DUPLICATE:
            stored = StoredResponse.from_result(outcome.result)
            await respond(send, stored.status, stored.replay_headers(), stored.body)
        else:
            await self._problem(send, Problem.in_flight())

    async def _on_own_connection(
        self, message_id: str, handler: Callable[[Any], Awaitable[dict[str, Any]]], fingerprint: str
    ) -> Outcome[dict[str, Any]]:
        """The guard on a connection the middleware checked out and has not begun.

        The guard then begins the transaction itself rather than a savepoint inside one of the
        middleware's: no savepoint is needed, because nothing outlives a failure here (a handler
        that raised, or a response that is not stored, rolls the whole transaction back).
        PostgreSQL: the key's in-flight lock comes first (:mod:`idemq.integrations._inflight`);
        a key still running is IN_PROGRESS with nothing claimed.
        """
        store = self.store
        assert isinstance(store, AsyncSqlStore)
        with translated(f"connect on {store.where}"):
            conn = await store.engine.connect()
        try:
            if not await self._lock_in_flight(conn, message_id):
                return Outcome(Status.IN_PROGRESS, message_id)
            return await self.guard.process(
                message_id, handler, payload=fingerprint, connection=conn
            )
        finally:
            with translated(f"close on {store.where}"):
                await _end_driver_transaction(conn)
                await conn.close()

    async def _lock_in_flight(self, conn: AsyncConnection, message_id: str) -> bool:
        """PostgreSQL: take the key's in-flight lock, trying again for up to ``wait_s``; False
        when it stayed taken. Other databases: True (the claim waits on the row lock)."""
        if conn.dialect.name != "postgresql":
            return True
        statement = try_lock_sql(self.guard.consumer, message_id)
        pauses = lock_pauses(self.wait_s)
        while not await _try_lock(conn, statement):
            pause_s = next(pauses, None)
            if pause_s is None:
                return False
            await asyncio.sleep(pause_s)
        return True

    def _judge(self, capture: Capture) -> dict[str, Any]:
        """The stored form of the captured response, or :class:`_NotStored` to undo the run."""
        if capture.status is None:
            raise RuntimeError("the app returned without starting a response")
        if capture.unstorable is not None:
            log.warning("response not stored: %s", capture.unstorable)
            raise self._not_stored(Problem.unstorable(capture.unstorable))
        if capture.size > self.max_response_bytes:
            log.warning(
                "response of %d bytes is over max_response_bytes=%d: not stored, rolled back",
                capture.size,
                self.max_response_bytes,
            )
            raise self._not_stored(Problem.response_too_large(self.max_response_bytes))
        if capture.status not in self.stored_statuses:
            raise _NotStored(capture.status, capture.headers, capture.joined())
        body = capture.joined()
        return StoredResponse.of(capture.status, capture.headers, body).to_result()

    def _not_stored(self, problem: Problem) -> _NotStored:
        body = problem.body(self.problem_type_base)
        return _NotStored(problem.status, problem.headers(body), body)

    async def _problem(self, send: Send, problem: Problem) -> None:
        body = problem.body(self.problem_type_base)
        await respond(send, problem.status, problem.headers(body), body)


async def _try_lock(conn: AsyncConnection, statement: str) -> bool:
    """Run the in-flight lock's ``statement`` in ``conn``'s transaction; its answer.

    psycopg: on the driver's own cursor, so SQLAlchemy's connection stays un-begun and the
    guard's ``connection.begin()`` makes the transaction its own (psycopg began it with this
    statement, as a DB-API driver does; the guard's COMMIT or ROLLBACK ends it). Through
    SQLAlchemy instead, the guard would nest a savepoint in a begun connection: two more round
    trips, the path other drivers take.
    """
    if conn.dialect.driver != "psycopg":
        with translated("in-flight lock"):
            return bool((await conn.exec_driver_sql(statement)).scalar_one())
    with translated("in-flight lock"):
        driver = (await conn.get_raw_connection()).driver_connection
    assert driver is not None  # a checked-out connection has its driver's
    try:
        async with driver.cursor() as cursor:
            await cursor.execute(statement)
            row = await cursor.fetchone()
    except conn.dialect.loaded_dbapi.Error as exc:
        wrapped = DBAPIError.instance(None, None, exc, conn.dialect.loaded_dbapi.Error)
        raise translate_db_error(wrapped, "in-flight lock") from exc
    return bool(row is not None and row[0])


async def _end_driver_transaction(conn: AsyncConnection) -> None:
    """psycopg: roll back what the in-flight lock began and the guard did not end (the lock
    was taken, so the guard never ran). The store's pool does not reset a connection it gets
    back, and one left in a transaction would carry a lock, or an aborted state, to its next
    user. No round trip when the guard's COMMIT or ROLLBACK already ended it; a connection
    that cannot roll back is discarded."""
    if conn.dialect.driver != "psycopg" or conn.invalidated:
        return
    driver = (await conn.get_raw_connection()).driver_connection
    assert driver is not None  # a checked-out connection has its driver's
    try:
        await driver.rollback()
    except conn.dialect.loaded_dbapi.Error:
        await conn.invalidate()
