"""``DjangoStore``: the dedup table on Django's own database connection.

Transactional mode (the default of :class:`~idemq.Idempotency` on a SQL store): the claim, the
handler's ORM writes and the dedup row's result all run on the connection Django holds for
``using``, inside ``transaction.atomic(using=…)`` — a transaction of its own, or a savepoint
when the guard is called inside the caller's ``atomic()`` block — so they commit or roll back
together. The statements are the :class:`~idemq.SqlStore`'s own plans, compiled for the
database's dialect (:mod:`idemq.integrations.django._sql`).

Lease mode and the operator's primitives (stats, purge, inspect, forget) run on a connection
of idemq's own to the same database (``DATABASES[using]``): a lease claim must commit at once,
whatever transaction the caller has open, or no other worker would see it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import sqlalchemy as sa

from idemq.drivers.sql import Plan, driver_reports_aborts, transaction_aborted, translated
from idemq.errors import ConfigurationError, StoreError, TransactionLostError
from idemq.integrations.django._schema import configured_tables
from idemq.integrations.django._sql import (
    CursorRunner,
    translate_driver_error,
    wrap_driver_error,
)
from idemq.integrations.django._urls import database_url
from idemq.stores.base import (
    Claim,
    ClaimRequest,
    Key,
)
from idemq.stores.sql.plans import SqlPlans
from idemq.stores.sql.store import Primitive, SqlStore, SqlStoreAdmin

__all__ = ["DjangoStore"]

T = TypeVar("T")


class DjangoStore(SqlStoreAdmin):
    """The dedup table on the Django database ``using`` (an alias of ``DATABASES``).

    ``Idempotency(DjangoStore(), consumer=…)`` runs each handler inside
    ``transaction.atomic(using=using)``; ``tx`` is Django's connection (``connections[using]``)
    and the handler's ORM writes join the dedup transaction. Called inside your own
    ``atomic()`` block, the guard's transaction is a savepoint of yours: pass
    ``connection=connections[using]`` to ``process`` then, so the guard knows you commit
    (a deadlock goes to you instead of being retried, and no local cache counts the message
    done before your COMMIT).

    The table is made by the app's migrations (``idemq.integrations.django`` in
    ``INSTALLED_APPS``, then ``manage.py migrate``); ``table=None`` is the one they make (the
    setting ``IDEMQ_TABLE``, else ``message_idempotent``). ``lease_clock`` and
    ``expires_after_s`` as for :class:`~idemq.SqlStore`; ``engine_kwargs`` go to the engine of
    idemq's own connection (lease mode, the operator's commands). ``savepoint=False``: inside
    an open ``atomic()`` block the guard's transaction joins it instead of nesting a savepoint
    (``atomic(savepoint=False)``), so a handler's failure dooms the whole block; for a caller
    that rolls all of it back on any failure (the HTTP middleware), two round trips fewer.
    """

    def __init__(
        self,
        using: str = "default",
        table: str | None = None,
        *,
        lease_clock: str | None = None,
        expires_after_s: float | None = None,
        savepoint: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        from django.db import connections  # noqa: PLC0415 -- needs configured settings

        if using not in connections.settings:
            raise ConfigurationError(f"no database {using!r} in Django's DATABASES")
        if table is None:
            table = configured_tables()[0]
        self.using = using
        self._wrapper = connections[using]
        url = database_url(
            self._wrapper.settings_dict, self._wrapper.Database.__name__, own_connection=False
        )
        super().__init__(
            url,
            table,
            schema=None,
            mysql_flavor=None,
            lease_clock=lease_clock,
            expires_after_s=expires_after_s,
        )
        self.where = f"Django database {using!r} table {table}"
        self._table_name = table
        self.savepoint = savepoint
        self._engine_kwargs = engine_kwargs
        self._expires_after_s = expires_after_s
        self._own: SqlStore | None = None
        self._runner: CursorRunner | None = None
        self._ready = threading.Lock()

    # -- idemq's own connection ---------------------------------------------------------------

    def own_store(self) -> SqlStore:
        """The :class:`~idemq.SqlStore` on idemq's own connection to the same database and
        table (built on first use, from the connection's settings as they are then: Django's
        test runner renames the database before the first test)."""
        with self._ready:
            if self._own is None:
                url = database_url(self._wrapper.settings_dict, self._wrapper.Database.__name__)
                self._own = SqlStore(
                    url,
                    table=self._table_name,
                    lease_clock=self.lease_clock,
                    expires_after_s=self._expires_after_s,
                    **self._engine_kwargs,
                )
            return self._own

    def _own_transaction(self, doing: str, primitive: Primitive[T]) -> T:
        """On idemq's own connection: :meth:`own_store`'s short transaction (the operator's
        tools of :class:`~idemq.stores.sql.store.SqlStoreAdmin` run here)."""
        return self.own_store()._own_transaction(doing, primitive)

    def _cursor_runner(self) -> CursorRunner:
        if self._runner is None:
            if self.url.get_backend_name() == "sqlite":
                # No connection of idemq's own: Django's test databases on SQLite are in
                # memory, where another connection would see none of Django's tables, and
                # inside atomic() Django holds the file's only write lock. The dialect knows
                # the library already; this engine never connects.
                dialect = sa.create_engine(sa.URL.create("sqlite+pysqlite")).dialect
            else:
                own = self.own_store()
                dialect = own.engine.dialect
                # One connect teaches the dialect the server (MariaDB or MySQL, its version:
                # what the statements may use, RETURNING above all).
                with translated(f"connect to {self.where}"), own.engine.connect():
                    pass
                # Transactional mode never uses this connection again: not kept open for it.
                own.engine.dispose()
            self._runner = CursorRunner(dialect, dialect.loaded_dbapi, self.where)
        return self._runner

    def _store_plans(self) -> SqlPlans:
        runner = self._cursor_runner()
        return self._plans_for(runner.dialect)

    @property
    def dialect(self) -> sa.Dialect:
        """The SQLAlchemy dialect the statements are compiled with."""
        return self._cursor_runner().dialect

    # -- transactions on Django's connection --------------------------------------------------

    def _alias(self, connection: Any) -> str:
        if connection is None:
            return self.using
        alias = connection if isinstance(connection, str) else getattr(connection, "alias", None)
        if alias != self.using:
            raise ConfigurationError(
                f"connection must be Django's connection (or alias) of database {self.using!r}, "
                f"got {connection!r}"
            )
        return alias

    @contextmanager
    def transaction(self, connection: Any = None) -> Iterator[Any]:
        """``transaction.atomic(using=…)`` on Django's connection; yields that connection.

        A savepoint inside an open ``atomic()`` block (with ``savepoint=False``: that block
        itself), a transaction that commits here otherwise. A failure to begin, commit or roll
        back is raised as an idemq error; what the block raises goes on as it is.
        """
        from django.db import connections, transaction  # noqa: PLC0415

        using = self._alias(connection)
        self._cursor_runner()  # before the transaction: it may connect on its own
        raised: BaseException | None = None
        try:
            with transaction.atomic(using=using, savepoint=self.savepoint):
                try:
                    yield connections[using]
                except BaseException as body_error:
                    raised = body_error
                    raise
        except Exception as error:
            if error is raised:
                raise
            self._raise_translated(error, "commit")

    def _raw(self, tx: Any) -> Any:
        """The DB-API connection under Django's connection ``tx``."""
        from django.db import connections  # noqa: PLC0415

        wrapper = connections[self._alias(tx)]
        wrapper.ensure_connection()
        return wrapper.connection

    def _in_transaction(self, tx: Any, doing: str, primitive: Callable[[SqlPlans], Plan[T]]) -> T:
        runner = self._cursor_runner()
        return runner.run(self._raw(tx), primitive(self._store_plans()), doing)

    def begin_savepoint(self, tx: Any) -> Any:
        """A savepoint (``transaction.savepoint``) for one batch message's writes."""
        from django.db import transaction  # noqa: PLC0415

        using = self._alias(tx)
        with self._translated("savepoint"):
            return using, transaction.savepoint(using=using)

    def end_savepoint(self, savepoint: Any, *, commit: bool) -> None:
        """Release the savepoint (``commit``) or roll back to it; an error means the whole
        transaction is gone (InnoDB rolls it back on a deadlock) and goes on."""
        from django.db import transaction  # noqa: PLC0415

        using, sid = savepoint
        doing = "release savepoint" if commit else "rollback to savepoint"
        with self._translated(doing):
            if commit:
                transaction.savepoint_commit(sid, using=using)
            else:
                transaction.savepoint_rollback(sid, using=using)

    @contextmanager
    def _translated(self, doing: str) -> Iterator[None]:
        try:
            yield
        except Exception as error:
            self._raise_translated(error, doing)

    def _raise_translated(self, error: Exception, doing: str) -> NoReturn:
        """Raise ``error`` as the idemq error it stands for, or as it is if it is none."""
        store_error = translate_driver_error(
            error, self._cursor_runner().dbapi, f"{doing} on {self.where}"
        )
        if store_error is None:
            raise error
        raise store_error from error

    def translate_handler_error(self, tx: Any, error: BaseException) -> StoreError | None:
        """The store error a handler's failed ORM statement stands for when the transaction
        is gone (deadlock, lost connection), else None (see
        :meth:`~idemq.stores.sql.store.SqlStoreBase.transaction_lost_by`)."""
        wrapped = wrap_driver_error(error, self._cursor_runner().dbapi)
        return None if wrapped is None else self.transaction_lost_by(wrapped)

    # -- transactional primitives -------------------------------------------------------------

    def claim_in(self, tx: Any, request: ClaimRequest) -> Claim:
        """Claim inside Django's open transaction (the row is written PROCESSED)."""
        return self._in_transaction(tx, "claim", lambda plans: plans.claim_unexpired(request, True))

    def claim_many_in(self, tx: Any, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim a batch inside Django's open transaction."""
        return self._in_transaction(
            tx, "claim_many", lambda plans: plans.claim_many(requests, True)
        )

    def _check_not_doomed(self, tx: Any, what: str) -> None:
        # A handler that caught a database error inside an inner atomic() block leaves the
        # transaction marked for rollback: Django rolls it back when the outer block ends, so
        # reporting PROCESSED would acknowledge a message whose row and effect never commit.
        from django.db import transaction  # noqa: PLC0415

        if transaction.get_rollback(using=self._alias(tx)):
            raise TransactionLostError(
                f"the transaction of {what} on {self.where} is marked for rollback (a database "
                "error was caught inside an atomic() block); nothing is committed, it runs again"
            )

    def confirm_in(
        self, tx: Any, key: Key, owner: str, result: str, *, deferred: bool = False
    ) -> None:
        """See :meth:`idemq.stores.base.TransactionalGuardStore.confirm_in`; also refuses a
        transaction Django has marked for rollback."""
        self._check_not_doomed(tx, f"{key.message_id!r} ({key.consumer})")
        primitive = self._confirm_plan(
            self._driver_connection(tx), key, owner, result, deferred=deferred
        )
        if primitive is not None:
            self._in_transaction(tx, "confirm", primitive)

    def confirm_many_in(self, tx: Any, requests: Sequence[ClaimRequest]) -> None:
        """See :meth:`idemq.stores.base.TransactionalGuardStore.confirm_many_in`."""
        if not requests:
            return
        self._check_not_doomed(tx, f"a batch of {len(requests)}")
        if self._must_read_rows(self._driver_connection(tx), requests):
            keys = [r.key for r in requests]
            owners = [r.owner for r in requests]
            self._in_transaction(tx, "confirm", lambda plans: plans.confirm_many(keys, owners))

    def _driver_connection(self, tx: Any) -> Any:
        """psycopg's connection under ``tx`` (it reports an aborted transaction), else None."""
        if not driver_reports_aborts(self.dialect):
            return None
        return self._raw(tx)

    def release_in(self, tx: Any, key: Key, owner: str) -> None:
        """Undo a batch claim of ``owner`` inside ``tx``."""
        self._in_transaction(tx, "release", lambda plans: plans.release_in(key, owner))

    def outbox_add_in(self, tx: Any, make_plan: Callable[[sa.Dialect], Any], doing: str) -> Any:
        """Carry out :class:`~idemq.Outbox`'s add plan (built by ``make_plan`` for the
        database's dialect) inside Django's open transaction on ``tx``, so
        ``Outbox(DjangoStore()).add(connection, …)`` joins the current ``atomic()``."""
        self._check_not_doomed(tx, "an outbox add")
        driver_connection = self._driver_connection(tx)
        if driver_connection is not None and transaction_aborted(driver_connection):
            raise TransactionLostError(
                f"{doing}: the transaction it joins was aborted by a failed statement (catch "
                "errors inside their own atomic() block); nothing would commit"
            )
        runner = self._cursor_runner()
        return runner.run_steps(self._raw(tx), make_plan(runner.dialect), doing)

    @property
    def engine(self) -> sa.Engine:
        """The engine of idemq's own connection to the database (the outbox's relay, the
        operator's commands)."""
        return self.own_store().engine

    # -- lease and operator's primitives: idemq's own connection ------------------------------

    def create_schema(self) -> None:
        """Create the dedup table if missing (the app's migrations do this in a project)."""
        self.own_store().create_schema()

    def claim(self, request: ClaimRequest) -> Claim:
        """Claim in lease mode, committed at once on idemq's own connection."""
        return self.own_store().claim(request)

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim a batch in lease mode."""
        return self.own_store().claim_many(requests)

    def complete(self, key: Key, owner: str, result: str, now_ms: int) -> None:
        """Mark PROCESSED; :class:`~idemq.LeaseLostError` if ``owner`` lost the lease."""
        self.own_store().complete(key, owner, result, now_ms)

    def release(self, key: Key, owner: str) -> None:
        """Delete the PROCESSING record if ``owner`` still holds it."""
        self.own_store().release(key, owner)

    def renew(self, key: Key, owner: str, lease_until_ms: int, now_ms: int) -> bool:
        """See :meth:`idemq.stores.base.GuardStore.renew`."""
        return self.own_store().renew(key, owner, lease_until_ms, now_ms)

    def close(self) -> None:
        """Close idemq's own connections (Django's stay Django's)."""
        with self._ready:
            if self._own is not None:
                self._own.close()
