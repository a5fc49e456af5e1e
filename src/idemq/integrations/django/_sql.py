"""idemq's SQL plans carried out on Django's own connection.

The stores' primitives are sans-I/O plans of SQLAlchemy statements (see
:mod:`idemq.stores.sql.plans`). Here each statement is compiled once with the SQLAlchemy dialect
of the database Django talks to, its parameters expanded and converted by SQLAlchemy's own bind
processors (:meth:`~sqlalchemy.sql.compiler.SQLCompiler.construct_expanded_state`), and it runs
on a DB-API cursor of the connection Django holds for ``using``: so a claim joins whatever
transaction Django has open there (``transaction.atomic``), and the SQL stays the one the
:class:`~idemq.SqlStore` runs, never a second copy written for Django.

The driver's own cursor is used, not Django's wrapper: the wrapper would rewrite the parameter
markers (SQLite) and raise Django's error classes, where idemq's translation reads the driver's.
"""

from __future__ import annotations

import threading
from collections import namedtuple
from collections.abc import Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import Executable
from sqlalchemy.sql.compiler import Compiled

from idemq._plan import drive
from idemq.drivers.sql import DriverStatement, Plan, Reply, Step, translate_db_error
from idemq.errors import StoreError

__all__ = ["CursorRunner", "driver_error", "translate_driver_error", "wrap_driver_error"]

T = TypeVar("T")


def driver_error(error: BaseException) -> BaseException | None:
    """The DB-API driver's exception behind ``error`` (Django wraps the driver's error in its
    own class and keeps it as ``__cause__``), or None when ``error`` is not a database error."""
    from django.db import DatabaseError as DjangoDatabaseError  # noqa: PLC0415 -- lazy: settings

    cause = error.__cause__
    if isinstance(error, DjangoDatabaseError) and cause is not None:
        return cause
    module = type(error).__module__.split(".")[0]
    if module in ("psycopg", "pymysql", "MySQLdb", "sqlite3"):
        return error
    return None


def wrap_driver_error(error: BaseException, dbapi: Any) -> DBAPIError | None:
    """``error`` (a driver's, or Django's wrapping of one) as SQLAlchemy's ``DBAPIError`` of the
    same kind, so :func:`idemq.drivers.sql.translate_db_error` — the one place idemq reads
    driver errors — judges it; None when it is no database error."""
    orig = driver_error(error)
    if not isinstance(orig, Exception):
        return None
    wrapped = DBAPIError.instance(None, None, orig, dbapi.Error)
    return wrapped if isinstance(wrapped, DBAPIError) else None


def translate_driver_error(error: BaseException, dbapi: Any, doing: str) -> StoreError | None:
    """The idemq error ``error`` (a driver's, or Django's wrapping of one) stands for, made by
    :func:`idemq.drivers.sql.translate_db_error`; None when it is no database error."""
    wrapped = wrap_driver_error(error, dbapi)
    return None if wrapped is None else translate_db_error(wrapped, doing)


class CursorRunner:
    """Runs plans on DB-API cursors of one database, compiled with ``dialect``."""

    def __init__(self, dialect: sa.Dialect, dbapi: Any, where: str) -> None:
        self.dialect = dialect
        self.dbapi = dbapi
        self.where = where
        self._compiled: dict[int, tuple[Executable, Compiled]] = {}
        self._lock = threading.Lock()

    def compiled(self, statement: Executable) -> Compiled:
        """``statement`` compiled once (plans build each statement once per store)."""
        entry = self._compiled.get(id(statement))
        if entry is None or entry[0] is not statement:
            compiled: Compiled = statement.compile(dialect=self.dialect)  # type: ignore[attr-defined]
            with self._lock:  # the statement is kept alive with its id, so the id stays its own
                self._compiled[id(statement)] = (statement, compiled)
            return compiled
        return entry[1]

    def run(self, raw_connection: Any, plan: Plan[T], doing: str) -> T:
        """Carry out ``plan`` on ``raw_connection`` (a DB-API connection) inside whatever
        transaction it has open; a database failure is raised into the plan as an idemq error
        naming ``doing``."""
        return drive(plan, lambda step: self._execute_translated(raw_connection, step, doing))

    def run_steps(self, raw_connection: Any, plan: Any, doing: str) -> Any:
        """:meth:`run` for the outbox's add plan (its own plan type: it yields the same
        :class:`Step`\\ s and reads each reply's ``rows`` and ``rowcount``)."""
        return drive(plan, lambda step: self._execute_translated(raw_connection, step, doing))

    def _execute_translated(self, raw_connection: Any, step: Step, doing: str) -> Reply:
        try:
            return self.execute(raw_connection, step)
        except self.dbapi.Error as error:
            translated = translate_driver_error(error, self.dbapi, f"{doing} on {self.where}")
            if translated is None:
                raise
            raise translated from error

    def execute(self, raw_connection: Any, step: Step) -> Reply:
        """One statement: compiled, expanded, its values converted; every row read back
        (a plan's :class:`DriverStatement` is compiled here from its Core statement, with this
        runner's dialect and its result processing)."""
        statement = step.statement
        if isinstance(statement, DriverStatement):
            statement = statement.statement
        compiled = self.compiled(statement)
        state = compiled.construct_expanded_state(dict(step.params))  # type: ignore[attr-defined]
        processors = state.processors
        values = {
            name: processors[name](value) if name in processors else value
            for name, value in state.parameters.items()
        }
        params: Any = (
            [values[name] for name in state.positiontup] if self.dialect.positional else values
        )
        cursor = raw_connection.cursor()
        try:
            cursor.execute(state.statement, params)
            if cursor.description is None:
                return Reply((), cursor.rowcount)
            rows = cursor.fetchall()
            return Reply(self._rows(statement, cursor.description, rows), cursor.rowcount)
        finally:
            cursor.close()

    def _rows(
        self, statement: Executable, description: Sequence[Any], rows: Sequence[Any]
    ) -> list[Any]:
        """Rows readable like SQLAlchemy's (by name and position), each value converted by
        its column type's result processor."""
        names = [column[0] for column in description]
        row_type = namedtuple("Row", names, rename=True)  # type: ignore[misc]
        columns = list(getattr(statement, "exported_columns", ()))
        converters = [
            self._converter(columns[i].type if i < len(columns) else None, description[i][1])
            for i in range(len(names))
        ]
        return [
            row_type(*(convert(value) for convert, value in zip(converters, row, strict=True)))
            for row in rows
        ]

    def _converter(self, type_: Any, coltype: Any) -> Any:
        if type_ is None:
            return _same
        processor = type_.dialect_impl(self.dialect).result_processor(self.dialect, coltype)
        if _is_datetime(type_) and self.dialect.name == "sqlite":
            # Django registers sqlite3 converters for DATETIME/TIMESTAMP columns, so a value may
            # come back parsed already; only SQLAlchemy's own text form goes through its parser.
            return _datetime_from_sqlite(type_, processor)
        if isinstance(type_, sa.JSON) and processor is None:
            return _json_text
        return processor or _same


def _same(value: Any) -> Any:
    return value


def _json_text(value: Any) -> Any:
    # Django's PostgreSQL backend loads JSON as text (its JSONField decodes it itself), where
    # SQLAlchemy expects psycopg to have decoded it.
    import json  # noqa: PLC0415

    return json.loads(value) if isinstance(value, str | bytes) else value


def _is_datetime(type_: Any) -> bool:
    return isinstance(type_, sa.DateTime) or isinstance(
        getattr(type_, "impl_instance", None), sa.DateTime
    )


def _datetime_from_sqlite(type_: Any, processor: Any) -> Any:
    decorate = getattr(type_, "process_result_value", None)

    def convert(value: Any) -> Any:
        if isinstance(value, str | bytes) or value is None:
            return processor(value) if processor is not None else value
        if decorate is not None:
            return decorate(value, None)
        return value

    return convert
