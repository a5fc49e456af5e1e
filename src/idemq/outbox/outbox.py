"""``Outbox.add``: an outgoing message written in the caller's transaction.

The row commits or rolls back with the business change beside it; a relay
(:class:`~idemq.outbox.relay.OutboxRelay`) publishes it after the commit. Both twins run one
plan (:func:`add_plan`, one INSERT); only the way the statement is executed differs.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection, Dialect, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from idemq._clock import system_clock_ms
from idemq._plan import Plan, adrive, drive
from idemq.drivers.sql import (
    Reply,
    Step,
    arun_step,
    driver_reports_aborts,
    run_step,
    transaction_aborted,
    translated,
)
from idemq.errors import (
    ConfigurationError,
    DuplicateKeyError,
    InvalidInputError,
    StoreError,
    TransactionLostError,
)
from idemq.outbox.ids import derived_ids, next_outbox_id
from idemq.outbox.schema import (
    DEFAULT_TABLE,
    adopt_or_create,
    check_table_name,
    ddl,
    tables_for,
)
from idemq.outbox.statements import Statements, statements_for
from idemq.stores.sql.versions import forget_version

__all__ = ["AsyncOutbox", "Outbox", "OutboxBase", "add_plan"]

MAX_KEY_LENGTH = 128
MAX_DESTINATION_LENGTH = 255
MAX_GENERATIONS = 1000  # runs of one message whose rows are all still there: not a real case


def add_plan(  # noqa: PLR0917 - the add's own arguments, in its order
    sql: Statements,
    destination: str,
    body: bytes,
    headers: Mapping[str, str] | None,
    ordering_key: str | None,
    now_ms: int,
    message_id: str | None = None,
) -> Plan[Step, str]:
    """Check the message, take its id, INSERT it; the answer is the id.

    With a ``message_id`` of the caller's, a row that already has it (waiting, kept after its
    send, or dead, or added by a racing transaction) is not added again, and that is no error:
    the caller can add the same message more than once. Inside a handler the id is derived
    (:func:`~idemq.outbox.ids.derived_ids`): one that a committed earlier run of the message
    holds is passed over for the next one.
    """
    if not isinstance(destination, str) or not 0 < len(destination) <= MAX_DESTINATION_LENGTH:
        raise InvalidInputError(f"outbox destination must be 1..255 characters: {destination!r}")
    if not isinstance(body, bytes | bytearray | memoryview):
        raise InvalidInputError(f"outbox body must be bytes, got {type(body).__name__}")
    if ordering_key is not None and (
        not isinstance(ordering_key, str) or not 0 < len(ordering_key) <= MAX_KEY_LENGTH
    ):
        raise InvalidInputError(f"ordering_key must be 1..128 characters: {ordering_key!r}")
    if headers and not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise InvalidInputError("outbox headers must map str to str")
    statement = sql.insert if ordering_key is None else sql.insert_keyed
    params = {
        "destination": destination,
        "body": bytes(body),
        "headers": json.dumps(dict(headers)) if headers else None,
        "ordering_key": ordering_key,
        "now_ms": now_ms,
        "channel": sql.channel,
    }
    if message_id is not None:
        if not isinstance(message_id, str) or not 0 < len(message_id) <= MAX_KEY_LENGTH:
            raise InvalidInputError(f"outbox message_id must be 1..128 characters: {message_id!r}")
        if not (yield Step(sql.has_id, {"id": message_id})).rows:
            # A racing add of the same id that committed first: it is there, once.
            with contextlib.suppress(DuplicateKeyError):
                yield Step(statement, {**params, "id": message_id})
        return message_id
    candidates = derived_ids()
    if candidates is None:  # outside a handler: a fresh id of this process
        fresh = next_outbox_id()
        yield Step(statement, {**params, "id": fresh})
        return fresh
    for candidate in itertools.islice(candidates, MAX_GENERATIONS):
        try:
            reply = yield Step(statement, {**params, "id": candidate})
        except DuplicateKeyError:  # MariaDB/MySQL; the others answer with a row count of 0
            continue
        if reply.rowcount:
            return candidate
    raise StoreError(f"outbox add: {MAX_GENERATIONS} derived ids of this message are all taken")


class OutboxBase:
    """What both twins share: the table name, the statements per dialect, the DDL."""

    def __init__(self, table: str, clock: Callable[[], int]) -> None:
        self.table = check_table_name(table)
        self.clock = clock
        self._statements: dict[str, Statements] = {}

    def statements(self, dialect: Dialect) -> Statements:
        """The statements of this table for ``dialect`` (built once)."""
        found = self._statements.get(dialect.name)
        if found is None:
            found = self._statements[dialect.name] = statements_for(dialect, self.table)
        return found

    def ddl(self, dialect: Dialect) -> str:
        """The outbox tables' DDL for ``dialect``."""
        return ddl(dialect, self.table)

    def _check_not_aborted(self, driver_connection: Any) -> None:
        # A handler that caught a failed statement without a savepoint of its own leaves
        # PostgreSQL's transaction aborted: its COMMIT rolls back, so the row would never be sent.
        if transaction_aborted(driver_connection):
            raise TransactionLostError(
                f"outbox add to {self.table}: the transaction it joins was aborted by a failed "
                "statement (catch errors inside tx.begin_nested()); nothing would commit"
            )


class Outbox(OutboxBase):
    """Outgoing messages kept in ``store``'s database until a relay publishes them.

    ``store``: an :class:`~idemq.SqlStore` (its engine is used). ``clock``: epoch ms.
    """

    def __init__(
        self,
        store: Any,
        *,
        table: str = DEFAULT_TABLE,
        clock: Callable[[], int] = system_clock_ms,
    ) -> None:
        super().__init__(table, clock)
        engine = getattr(store, "engine", None)
        if not isinstance(engine, Engine):
            raise ConfigurationError("Outbox needs a SqlStore (use AsyncOutbox for AsyncSqlStore)")
        self.store = store
        self.engine = engine
        self.where = f"{engine.url.render_as_string(hide_password=True)} table {self.table}"

    def __repr__(self) -> str:
        return f"Outbox({self.where!r})"

    def create_schema(self) -> None:
        """Create the outbox tables and indexes that are missing (safe to call twice)."""
        with translated(f"create outbox {self.table}"), self.engine.begin() as conn:
            adopt_or_create(conn, self.table)

    def drop_schema(self) -> None:
        """Drop both outbox tables (tests, teardown)."""
        with translated(f"drop outbox {self.table}"), self.engine.begin() as conn:
            for table in tables_for(conn.dialect, self.table):
                table.drop(conn, checkfirst=True)
                forget_version(conn, table.name)

    def add(
        self,
        conn_or_session: Any,
        destination: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        ordering_key: str | None = None,
        message_id: str | None = None,
    ) -> str:
        """Write one outgoing message in the transaction of ``conn_or_session`` (an SQLAlchemy
        ``Connection`` or ``Session``; with a :class:`~idemq.integrations.django.DjangoStore`,
        Django's connection); its id.

        The row commits or rolls back with that transaction: nothing is published for a change
        that rolled back, nothing is lost for one that committed. Inside a guarded handler the
        id is derived from the incoming message (the same on a rerun). One round trip.

        ``message_id``: the id to use instead (at most 128 characters); a message whose row is
        already in the outbox (waiting, kept or dead) is then not added twice — one more round
        trip, to look.
        """
        join = getattr(self.store, "outbox_add_in", None)
        if join is not None and not isinstance(conn_or_session, Connection | Session):
            # A store on a framework's own connection (DjangoStore): the row joins the
            # transaction that framework has open on it.
            added: str = join(
                conn_or_session,
                lambda dialect: add_plan(
                    self.statements(dialect),
                    destination,
                    body,
                    headers,
                    ordering_key,
                    self.clock(),
                    message_id,
                ),
                f"outbox add to {self.table}",
            )
            return added
        conn = _sync_connection(conn_or_session)
        doing = f"outbox add to {self.table}"
        if driver_reports_aborts(conn.dialect):
            with translated(doing):
                driver_connection = conn.connection.driver_connection
            self._check_not_aborted(driver_connection)
        plan = add_plan(
            self.statements(conn.dialect),
            destination,
            body,
            headers,
            ordering_key,
            self.clock(),
            message_id,
        )

        return drive(plan, lambda step: run_step(conn, step, doing))


class AsyncOutbox(OutboxBase):
    """The asyncio twin of :class:`Outbox` (``store``: an :class:`~idemq.AsyncSqlStore`).

    It has no relay of its own: run :class:`~idemq.OutboxRelay` (``idemq relay``) on the same
    database.
    """

    def __init__(
        self,
        store: Any,
        *,
        table: str = DEFAULT_TABLE,
        clock: Callable[[], int] = system_clock_ms,
    ) -> None:
        super().__init__(table, clock)
        engine = getattr(store, "engine", None)
        if engine is None:
            raise ConfigurationError("AsyncOutbox needs an AsyncSqlStore")
        self.store = store
        self.engine = engine

    async def create_schema(self) -> None:
        """Create the outbox tables and indexes that are missing (safe to call twice)."""
        with translated(f"create outbox {self.table}"):
            async with self.engine.begin() as conn:
                await conn.run_sync(lambda sync: adopt_or_create(sync, self.table))

    async def add(
        self,
        conn_or_session: AsyncConnection | AsyncSession,
        destination: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        ordering_key: str | None = None,
        message_id: str | None = None,
    ) -> str:
        """:meth:`Outbox.add` on an ``AsyncConnection`` or ``AsyncSession``, awaited."""
        if isinstance(conn_or_session, AsyncSession):
            conn = await conn_or_session.connection()
        elif isinstance(conn_or_session, AsyncConnection):
            conn = conn_or_session
        else:
            raise ConfigurationError(
                f"add needs an AsyncConnection or AsyncSession, got {type(conn_or_session)}"
            )
        doing = f"outbox add to {self.table}"
        if driver_reports_aborts(conn.dialect):
            with translated(doing):
                raw = await conn.get_raw_connection()
            self._check_not_aborted(raw.driver_connection)
        plan = add_plan(
            self.statements(conn.dialect),
            destination,
            body,
            headers,
            ordering_key,
            self.clock(),
            message_id,
        )

        async def execute(step: Step) -> Reply:
            return await arun_step(conn, step, doing)

        return await adrive(plan, execute)


def _sync_connection(conn_or_session: Any) -> Connection:
    if isinstance(conn_or_session, Session):
        return conn_or_session.connection()
    if isinstance(conn_or_session, Connection):
        return conn_or_session
    if conn_or_session is None:
        raise ConfigurationError(
            "outbox.add needs the transaction's Connection or Session (a Redis store has none:"
            " the outbox lives in a SQL database)"
        )
    raise ConfigurationError(
        f"outbox.add needs an SQLAlchemy Connection or Session, got {type(conn_or_session)}"
    )
