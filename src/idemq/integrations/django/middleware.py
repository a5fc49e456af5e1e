"""``IdempotencyKeyMiddleware``: the HTTP ``Idempotency-Key`` header for Django views.

The same rules as the ASGI middleware (:mod:`idemq.integrations.asgi`), from the same
framework-free core (:mod:`idemq.integrations.http`): key syntax, scoping, fingerprint, what is
stored, problem bodies. Here the store is a :class:`~idemq.integrations.django.DjangoStore`, so
in transactional mode the view runs inside ``transaction.atomic`` with the dedup row: its ORM
writes, the dedup row and the stored response commit together, and a response that is not
stored (5xx by default, or an exception Django turned into one) rolls them back — what is not
stored did not happen, and the retry runs once more without a second effect.

Settings, ``IDEMQ_HTTP = {…}``, the ASGI middleware's options by name: ``required``,
``methods``, ``scope``, ``key``, ``wait_s``, ``consumer``, ``mode``, ``lease_s``,
``stored_statuses``, ``max_key_chars``, ``max_request_bytes``, ``max_response_bytes``,
``problem_type_base``, ``clock``, ``observer``; and ``using`` / ``table`` (the dedup table's
database alias and name) or ``store`` (a store object, or the dotted path of one). Callables
(``scope``, ``key``, ``clock``, ``observer``) may be dotted paths. ``scope(request)`` and
``key(request)`` take Django's request (``request.body`` is read already).

Sync and async capable: under ASGI, a request it does not guard goes to an async view with no
thread hop; a guarded one runs its database work in Django's sync thread
(``sync_to_async(thread_sensitive=True)``), where an async view's own ORM calls run too, so
they share the dedup transaction's connection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from asgiref.sync import async_to_sync, iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.utils.module_loading import import_string

from idemq.drivers.sql import translated
from idemq.errors import (
    ConfigurationError,
    InvalidMessageIdError,
    LeaseLostError,
    PayloadMismatchError,
    StoreConflictError,
    StoreError,
)
from idemq.guard.core import Mode, Outcome, Status
from idemq.guard.idempotency import Idempotency
from idemq.integrations._inflight import lock_pauses, try_lock_sql
from idemq.integrations.django.store import DjangoStore
from idemq.integrations.http import (
    DEFAULT_METHODS,
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
from idemq.stores.base import Store, TransactionalStore

__all__ = ["IdempotencyKeyMiddleware"]

log = logging.getLogger("idemq.http")

_OPTIONS = frozenset(
    {
        "required",
        "methods",
        "scope",
        "key",
        "wait_s",
        "consumer",
        "mode",
        "lease_s",
        "stored_statuses",
        "max_key_chars",
        "max_request_bytes",
        "max_response_bytes",
        "problem_type_base",
        "clock",
        "observer",
        "store",
        "using",
        "table",
    }
)


class _NotStored(Exception):
    """Raised by the guarded handler for a response that is not stored, so the guard rolls
    back its transaction (or releases its claim)."""

    def __init__(self, response: HttpResponseBase) -> None:
        super().__init__(response.status_code)
        self.response = response


def _loaded(value: Any) -> Any:
    return import_string(value) if isinstance(value, str) else value


class IdempotencyKeyMiddleware:
    """Guard a Django project's ``POST``/``PATCH`` views with the ``Idempotency-Key`` header
    (see the module for the settings; ``options`` override ``IDEMQ_HTTP``, for tests)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any], **options: Any) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)
        config = {**getattr(settings, "IDEMQ_HTTP", {}), **options}
        unknown = sorted(set(config) - _OPTIONS)
        if unknown:
            raise ConfigurationError(f"IDEMQ_HTTP has unknown options {unknown}")
        self._configure(config)

    def _configure(self, config: dict[str, Any]) -> None:
        store = _loaded(config.get("store"))
        if store is None:
            # The guard's atomic() joins the middleware's rather than nesting a savepoint:
            # any failure rolls the whole request back (what is not stored did not happen).
            store = DjangoStore(
                using=config.get("using", "default"), table=config.get("table"), savepoint=False
            )
        if not isinstance(store, Store):
            raise ConfigurationError(f"IDEMQ_HTTP store must be a store, got {store!r}")
        mode = config.get("mode")
        wait_s = config.get("wait_s", 0)
        lease_s = float(config.get("lease_s", 30.0))
        max_key_chars = int(config.get("max_key_chars", MAX_KEY_CHARS))
        if not 0 < max_key_chars <= MAX_KEY_CHARS:
            raise ConfigurationError(f"max_key_chars must be 1-{MAX_KEY_CHARS}")
        if wait_s is not None and not wait_s >= 0:
            raise ConfigurationError(f"wait_s must be >= 0 or None, got {wait_s!r}")
        self.max_request_bytes = int(config.get("max_request_bytes", 1024 * 1024))
        self.max_response_bytes = int(config.get("max_response_bytes", 1024 * 1024))
        if self.max_request_bytes <= 0 or self.max_response_bytes <= 0:
            raise ConfigurationError("max_request_bytes and max_response_bytes must be positive")
        transactional = isinstance(store, TransactionalStore) and mode != Mode.LEASE
        self.store = store
        self.guard = Idempotency(
            store,
            consumer=config.get("consumer", "http"),
            mode=mode,
            lease_s=lease_s,
            # Transactional: a retry waits on the first request's row lock (bounded below),
            # not by polling; the guard's wait is a lease-mode option.
            wait_s=0 if transactional else (lease_s if wait_s is None else wait_s),
            clock=_loaded(config.get("clock")),
            observer=_loaded(config.get("observer")),
        )
        self.required = bool(config.get("required", False))
        methods: Iterable[str] = config.get("methods", DEFAULT_METHODS)
        self.methods = frozenset(m.upper() for m in methods)
        self.scope_fn = _loaded(config.get("scope"))
        self.key_fn = _loaded(config.get("key"))
        self.owns_transaction = self.guard.mode is Mode.TRANSACTIONAL and wait_s is not None
        self.wait_s = float(wait_s or 0)
        self.stored_statuses = _stored_statuses(config.get("stored_statuses"))
        self.max_key_chars = max_key_chars
        self.problem_type_base = config.get("problem_type_base")

    # -- the protocol -----------------------------------------------------------------------

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        if request.method not in self.methods:
            return self.get_response(request)
        return self._handle(request, self.get_response)

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        if request.method not in self.methods:
            response: HttpResponseBase = await self.get_response(request)
            return response
        # The guard and the store are sync (Django's ORM is): they run in Django's sync
        # thread, and the async view is driven from there, its ORM calls in that same thread.
        view = async_to_sync(self.get_response)
        handled: HttpResponseBase = await sync_to_async(self._handle, thread_sensitive=True)(
            request, view
        )
        return handled

    # -- one request of a guarded method ----------------------------------------------------

    def _handle(
        self, request: HttpRequest, view: Callable[[HttpRequest], HttpResponseBase]
    ) -> HttpResponseBase:
        if self.key_fn is None:
            try:
                key = self._header_key(request)
            except InvalidMessageIdError as exc:
                return self._problem(Problem.invalid_key(str(exc)))
            if key is None:
                return self._unguarded(request, view)
            body = self._body(request)
            if isinstance(body, HttpResponseBase):
                return body
        else:
            body = self._body(request)
            if isinstance(body, HttpResponseBase):
                return body
            try:
                key = self._callable_key(request)
            except InvalidMessageIdError as exc:
                return self._problem(Problem.invalid_key(str(exc)))
            if key is None:
                return self._unguarded(request, view)
        token = scope_token(self._scope_value(request))
        fingerprint = request_fingerprint(
            request.method or "",
            request.path,
            request.META.get("QUERY_STRING", "").encode("latin-1"),
            body,
        )
        return self._guarded(request, view, dedup_id(token, key), fingerprint)

    def _unguarded(
        self, request: HttpRequest, view: Callable[[HttpRequest], HttpResponseBase]
    ) -> HttpResponseBase:
        if self.required:
            return self._problem(Problem.missing_key())
        return view(request)

    def _body(self, request: HttpRequest) -> bytes | HttpResponseBase:
        """The request body, or a 413 before reading one that says it is over the limit."""
        try:
            declared = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            declared = 0
        if declared > self.max_request_bytes:
            return self._problem(Problem.request_too_large(self.max_request_bytes))
        body = request.body
        if len(body) > self.max_request_bytes:
            return self._problem(Problem.request_too_large(self.max_request_bytes))
        return body

    def _header_key(self, request: HttpRequest) -> str | None:
        raw = request.META.get("HTTP_IDEMPOTENCY_KEY")
        if raw is None:
            return None
        # Two header lines arrive joined by a comma: parse_key refuses what follows the key.
        return check_key(parse_key(raw.encode("latin-1")), self.max_key_chars)

    def _callable_key(self, request: HttpRequest) -> str | None:
        try:
            found = self.key_fn(request)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidMessageIdError(f"the request's key could not be read: {exc}") from exc
        if found is None:
            return None
        if not isinstance(found, str):
            raise InvalidMessageIdError(f"key= returned {type(found).__name__}, not str")
        return check_key(found, self.max_key_chars)

    def _scope_value(self, request: HttpRequest) -> str | bytes | None:
        if self.scope_fn is not None:
            value: str | bytes | None = self.scope_fn(request)
            return value
        credentials = request.META.get("HTTP_AUTHORIZATION")
        return None if credentials is None else credentials.encode("latin-1")

    # -- the guard --------------------------------------------------------------------------

    def _guarded(
        self,
        request: HttpRequest,
        view: Callable[[HttpRequest], HttpResponseBase],
        message_id: str,
        fingerprint: str,
    ) -> HttpResponseBase:
        responses: list[HttpResponseBase] = []

        def handler(tx: Any) -> dict[str, Any]:
            response = view(request)
            responses.append(response)
            return self._judge(response)

        outcome: Outcome[dict[str, Any]]
        try:
            if self.owns_transaction:
                store = self.store
                assert isinstance(store, TransactionalStore)
                with store.transaction() as conn:
                    if _lock_in_flight(conn, self.guard.consumer, message_id, self.wait_s):
                        outcome = self.guard.process(
                            message_id, handler, payload=fingerprint, connection=conn
                        )
                    else:
                        outcome = Outcome(Status.IN_PROGRESS, message_id)
            else:
                outcome = self.guard.process(message_id, handler, payload=fingerprint)
        except _NotStored as not_stored:
            return not_stored.response
        except PayloadMismatchError:
            return self._problem(Problem.reused())
        except (StoreConflictError, LeaseLostError):
            # Transactional: a deadlock rolled this one back, or (a database without the
            # in-flight lock) the first request's row lock outlasted the server's lock
            # timeout: nothing was written, a retry is safe.
            return self._problem(Problem.in_flight())
        except StoreError:
            log.warning("idempotency store failed for %s", message_id, exc_info=True)
            return self._problem(Problem.store_unavailable())
        if outcome.status is Status.PROCESSED:
            return responses[-1]
        if outcome.status is Status.DUPLICATE:
            return _replay(StoredResponse.from_result(outcome.result))
        return self._problem(Problem.in_flight())

    def _judge(self, response: HttpResponseBase) -> dict[str, Any]:
        """The stored form of ``response``, or :class:`_NotStored` to undo the run."""
        body = self._stored_body(response)
        if body is None:
            raise _NotStored(self._problem(self._too_large(response)))
        if response.status_code not in self.stored_statuses:
            raise _NotStored(response)
        headers = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in response.items()
        ]
        return StoredResponse.of(response.status_code, headers, body).to_result()

    def _too_large(self, response: HttpResponseBase) -> Problem:
        if getattr(response, "is_async", False):
            return Problem.unstorable("an async streaming response cannot be stored for replay")
        log.warning(
            "response over max_response_bytes=%d: not stored, rolled back",
            self.max_response_bytes,
        )
        return Problem.response_too_large(self.max_response_bytes)

    def _stored_body(self, response: HttpResponseBase) -> bytes | None:
        """The whole body (a streamed one is read here and handed on as it was read), or None
        when it cannot be stored: over ``max_response_bytes``, or streamed asynchronously."""
        if not response.streaming:
            content: bytes = response.content
            return content if len(content) <= self.max_response_bytes else None
        if getattr(response, "is_async", False):
            return None
        chunks: list[bytes] = []
        size = 0
        for chunk in response.streaming_content:
            size += len(chunk)
            if size > self.max_response_bytes:
                return None
            chunks.append(bytes(chunk))
        response.streaming_content = chunks
        return b"".join(chunks)

    def _problem(self, problem: Problem) -> HttpResponse:
        return HttpResponse(
            problem.body(self.problem_type_base),
            status=problem.status,
            content_type="application/problem+json",
        )


def _replay(stored: StoredResponse) -> HttpResponse:
    """The stored response, with ``Idempotent-Replayed: true``."""
    response = HttpResponse(stored.body, status=stored.status)
    del response["Content-Type"]  # only what was stored
    for name, value in stored.replay_headers():
        response[name.decode("latin-1")] = value.decode("latin-1")
    return response


def _lock_in_flight(conn: Any, consumer: str, message_id: str, wait_s: float) -> bool:
    """PostgreSQL: take the key's in-flight lock in ``conn``'s transaction, trying again for up
    to ``wait_s`` (:mod:`idemq.integrations._inflight`); False when it stayed taken. Other
    databases: True, and the claim waits on the first request's row as their lock timeout says.
    """
    vendor = getattr(conn, "vendor", None)  # Django's connection (a DjangoStore's tx)
    if (conn.dialect.name if vendor is None else vendor) != "postgresql":
        return True
    statement = try_lock_sql(consumer, message_id)
    pauses = lock_pauses(wait_s)
    while not _try_lock(conn, statement, on_django=vendor is not None):
        pause_s = next(pauses, None)
        if pause_s is None:
            return False
        time.sleep(pause_s)
    return True


def _try_lock(conn: Any, statement: str, *, on_django: bool) -> bool:
    if not on_django:  # an SQLAlchemy Connection: IDEMQ_HTTP named a SqlStore
        with translated("in-flight lock"):
            return bool(conn.exec_driver_sql(statement).scalar_one())
    with conn.cursor() as cursor:
        cursor.execute(statement)
        row = cursor.fetchone()
    return bool(row is not None and row[0])
