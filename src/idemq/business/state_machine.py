"""Business state machine: the second line of defence behind the dedup table.

A dedup table stops the *same* message twice. It cannot stop two *different* messages that mean
the same thing (a producer retry that got a new id, a replayed export), nor out-of-order delivery
(``ship`` before ``pay``). The business row can: "move to PAID only if the order is still
PENDING_PAYMENT; if it is already PAID (or past it), report success and do nothing".

:meth:`StateMachine.apply` does that with **one conditional UPDATE**::

    UPDATE orders SET status = 'PAID' [, extra…] [, fence_token = :fence]
     WHERE order_id = :key AND status IN ('PENDING_PAYMENT', 'PAYMENT_FAILED')
       [AND (fence_token IS NULL OR fence_token <= :fence)]

The database serialises racing UPDATEs on the row, so exactly one of N racing workers sees
``rowcount == 1`` — there is no read-then-write window. Only when no row changed does it read the
row (``SELECT … FOR UPDATE``, inside the caller's transaction) to say *why*:

* at or past the target state → :attr:`TransitionResult.ALREADY_APPLIED` (ack, do nothing);
* the write carried an older fencing token than the row has seen → :attr:`TransitionResult.FENCED`;
* otherwise (e.g. ``ship`` while PENDING_PAYMENT) → :attr:`TransitionResult.REJECTED`;
* no row → :attr:`TransitionResult.NOT_FOUND`.

The classifying SELECT is a *locking* read on purpose: under MariaDB's REPEATABLE READ a plain
SELECT may answer from a snapshot older than the row the UPDATE just looked at, and would report
a source state although the UPDATE saw the target.

``states`` is ordered along the happy path; "past the target" means a later index. Keep side
exits that must not count as progress (CANCELLED, REFUNDED …) out of the middle of the list.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from sqlalchemy import Select, Update, bindparam, select, update

from idemq.business._sql import (
    bind_prefix,
    bind_type,
    check_columns,
    check_identifier,
    fence_accepts,
)
from idemq.business._sql import table_clause as _table
from idemq.drivers.sql import Plan, Step, arun, run
from idemq.errors import ConfigurationError, InvalidInputError, UnknownEventError

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    from sqlalchemy.orm import Session
    from sqlalchemy.types import TypeEngine

__all__ = ["StateMachine", "Transition", "TransitionResult"]

# A row whose state moves backwards (a "retry" edge) between our UPDATE and our SELECT can look
# like a legal source state that the UPDATE nevertheless did not match; the UPDATE is then simply
# tried again. Bounded, because it can only happen while another writer keeps flipping the row.
_MAX_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class _Shape:
    """The statements of one kind of :meth:`StateMachine.apply` call, and its fixed binds."""

    update: Update
    probe: Select[Any]
    fixed: dict[str, Any]  # target and source states
    key_bind: str
    fence_bind: str
    extra_binds: tuple[str, ...]  # the bind of each extra column, in order


class TransitionResult(enum.StrEnum):
    """What :meth:`StateMachine.apply` did. A ``str`` enum, so a handler can return it as JSON.

    How a consumer should react (see ``examples/orders/README.md``):

    * ``APPLIED`` — this call made the transition; do the side effects that belong to it; ack.
    * ``ALREADY_APPLIED`` — the row is at or past the target (a duplicate under another id, or a
      late replay); do **nothing** else; ack.
    * ``REJECTED`` — the event is not legal from the current state (``ship`` before ``pay``):
      usually out-of-order delivery; retry later, dead-letter after N attempts.
    * ``NOT_FOUND`` — no row with that key (yet); retry later, dead-letter after N attempts.
    * ``FENCED`` — the transition was legal but the write carried an older fencing token than
      the row has already seen: this worker's lock expired and a newer holder wrote; drop the
      work (ack without effect — the newer holder owns it).
    """

    APPLIED = "APPLIED"
    ALREADY_APPLIED = "ALREADY_APPLIED"
    REJECTED = "REJECTED"
    NOT_FOUND = "NOT_FOUND"
    FENCED = "FENCED"

    @property
    def ok(self) -> bool:
        """True when the business effect of the event is in place (APPLIED or ALREADY_APPLIED)."""
        return self in (TransitionResult.APPLIED, TransitionResult.ALREADY_APPLIED)


@dataclass(frozen=True, slots=True)
class Transition:
    """One event's edge(s): from any of ``sources`` to ``target``."""

    event: str
    sources: tuple[str, ...]
    target: str


class StateMachine:
    """Apply named events to a state column with one conditional UPDATE per event.

    ::

        orders = idemq.StateMachine(
            "orders", "order_id", "status",
            states=["PENDING_PAYMENT", "PAYMENT_FAILED", "PAID", "SHIPPED"],
            transitions={
                "pay": (("PENDING_PAYMENT", "PAYMENT_FAILED"), "PAID"),
                "ship": ("PAID", "SHIPPED"),
            },
        )
        with engine.begin() as conn:
            if orders.apply(conn, "o-1", "pay") is idemq.TransitionResult.APPLIED:
                debit(conn, ...)      # only the one call that moved the row does the side effect

    Names are validated as SQL identifiers here (→ :class:`~idemq.ConfigurationError`); keys,
    states and extra values are always bound parameters. ``fence_column`` is only touched by
    calls that pass ``fence=``. The machine holds no connection and is safe to share.
    """

    def __init__(
        self,
        table: str,
        key_column: str,
        state_column: str,
        states: Sequence[str],
        transitions: Mapping[str, tuple[str | Iterable[str], str]],
        *,
        fence_column: str = "fence_token",
    ) -> None:
        self.table = table
        self.key_column = check_identifier(key_column, "key_column")
        self.state_column = check_identifier(state_column, "state_column")
        self.fence_column = check_identifier(fence_column, "fence_column")
        managed = [self.key_column, self.state_column, self.fence_column]
        if len(set(managed)) != len(managed):
            raise ConfigurationError(
                f"key_column, state_column and fence_column must differ, got {managed}"
            )
        _table(table)  # validates the (optionally schema-qualified) table name now, not at apply
        self.states: tuple[str, ...] = _check_states(states)
        self._rank = {state: index for index, state in enumerate(self.states)}
        self.transitions: dict[str, Transition] = {
            event: self._check_transition(event, edge) for event, edge in transitions.items()
        }
        if not self.transitions:
            raise ConfigurationError("a StateMachine needs at least one transition")
        # What a statement of this machine is built from, besides the call's own kind.
        self._names = (table, self.key_column, self.state_column, self.fence_column)

    def __repr__(self) -> str:
        return (
            f"StateMachine(table={self.table!r}, key_column={self.key_column!r}, "
            f"state_column={self.state_column!r}, events={sorted(self.transitions)})"
        )

    def apply(
        self,
        conn: Connection | Session,
        key: Any,
        event: str,
        extra_values: Mapping[str, Any] | None = None,
        *,
        fence: int | None = None,
    ) -> TransitionResult:
        """Apply ``event`` to the row ``key`` inside ``conn``'s current transaction (``conn``: a
        ``Connection``, e.g. a handler's ``tx``, or an ORM ``Session``).

        ``extra_values`` (column → value, bound as parameters) are written only together with the
        transition, e.g. ``{"paid_by": message_id}``. ``fence`` is a fencing token (e.g.
        ``RedisLock.fencing_token``): the write is refused with :attr:`TransitionResult.FENCED`
        when the row has already seen a larger token, and the row remembers this one otherwise.

        Raises :class:`UnknownEventError` for an event with no transition,
        :class:`~idemq.ConfigurationError` for bad ``extra_values`` columns, and
        :class:`~idemq.StoreError` subclasses (cause kept) when the database fails.
        """
        plan = self._plan(key, event, extra_values, fence)
        return run(conn, plan, f"{event!r} on {self.table}")

    async def apply_async(
        self,
        conn: AsyncConnection | AsyncSession,
        key: Any,
        event: str,
        extra_values: Mapping[str, Any] | None = None,
        *,
        fence: int | None = None,
    ) -> TransitionResult:
        """:meth:`apply` on a SQLAlchemy ``AsyncConnection``; same statements, same results."""
        plan = self._plan(key, event, extra_values, fence)
        return await arun(conn, plan, f"{event!r} on {self.table}")

    def transition(self, event: str) -> Transition:
        """The transition for ``event``; raise :class:`UnknownEventError` if there is none."""
        try:
            return self.transitions[event]
        except (KeyError, TypeError) as error:
            raise UnknownEventError(
                f"unknown event {event!r} for {self.table}; known: {sorted(self.transitions)}"
            ) from error

    # -- the logic, written once: yields statements, receives results -------------------------

    def _plan(
        self,
        key: Any,
        event: str,
        extra_values: Mapping[str, Any] | None,
        fence: int | None,
    ) -> Plan[TransitionResult]:
        edge = self.transition(event)
        extra = dict(extra_values or {})
        fence = _check_fence(fence)
        fenced = fence is not None
        shape = _shape(self._names, edge, tuple(extra), fenced, bind_type(key))
        params = {**shape.fixed, shape.key_bind: key}
        for bind, value in zip(shape.extra_binds, extra.values(), strict=True):
            params[bind] = value
        if fenced:
            params[shape.fence_bind] = fence

        for _ in range(_MAX_ATTEMPTS):
            matched = (yield Step(shape.update, params)).rowcount
            if matched == 1:
                return TransitionResult.APPLIED
            if matched > 1:
                raise ConfigurationError(
                    f"{self.table}.{self.key_column} is not unique: {matched} rows matched "
                    f"{key!r}; roll back the transaction"
                )
            rows = (yield Step(shape.probe, {shape.key_bind: key})).rows
            if not rows:
                return TransitionResult.NOT_FOUND
            found = tuple(rows[0])  # (state,) or (state, fence_token)
            verdict = self._classify(edge, found[0], found[1] if fenced else None, fence)
            if verdict is not None:
                return verdict
        return TransitionResult.REJECTED

    def _classify(
        self, edge: Transition, state: Any, row_fence: Any, fence: int | None
    ) -> TransitionResult | None:
        """Why did the UPDATE match no row? ``None`` means "it would match now: try again"."""
        if state not in self._rank:
            raise ConfigurationError(
                f"{self.table}.{self.state_column} holds {state!r}, which is not one of the "
                f"configured states {list(self.states)}"
            )
        if self._rank[state] >= self._rank[edge.target] and state not in edge.sources:
            return TransitionResult.ALREADY_APPLIED
        if state not in edge.sources:
            return TransitionResult.REJECTED
        if fence is not None and row_fence is not None and row_fence > fence:
            return TransitionResult.FENCED
        return None

    def _check_transition(self, event: object, edge: object) -> Transition:
        if not isinstance(event, str) or not event:
            raise ConfigurationError(f"event names must be non-empty strings, got {event!r}")
        if not isinstance(edge, tuple) or len(edge) != 2:
            raise ConfigurationError(
                f"transition {event!r} must be a (source(s), target) pair, got {edge!r}"
            )
        raw_sources, target = edge
        sources = (raw_sources,) if isinstance(raw_sources, str) else tuple(raw_sources)
        for state in (*sources, target):
            if state not in self._rank:
                raise ConfigurationError(
                    f"transition {event!r} names unknown state {state!r}; "
                    f"states are {list(self.states)}"
                )
        if not sources:
            raise ConfigurationError(f"transition {event!r} has no source state")
        if target in sources:
            # A self-loop would report APPLIED on every replay: exactly what the guard prevents.
            raise ConfigurationError(
                f"transition {event!r} lists its target {target!r} as a source"
            )
        return Transition(event=event, sources=tuple(dict.fromkeys(sources)), target=target)


@lru_cache(maxsize=256)
def _shape(
    names: tuple[str, str, str, str],
    edge: Transition,
    extra_cols: tuple[str, ...],
    fenced: bool,
    key_type: TypeEngine[Any],
) -> _Shape:
    """The statements of one kind of :meth:`StateMachine.apply` call, built once and shared by
    machines of the same table and columns.

    ``key_type`` is part of the shape (see :func:`idemq.business._sql.bind_type`): a
    ``uuid.UUID`` key is converted on SQLite, a str is not.
    """
    table, key_name, state_name, fence_name = names
    check_columns(extra_cols, "extra_values", {key_name, state_name, fence_name})
    tbl = _table(table, key_name, state_name, fence_name, *extra_cols)
    key_col, state_col, fence_col = tbl.c[key_name], tbl.c[state_name], tbl.c[fence_name]
    b = bind_prefix(tbl.c.keys())
    key_bind = bindparam(f"{b}key", type_=key_type)
    target = f"{b}target"
    sources = [f"{b}source{i}" for i in range(len(edge.sources))]
    extra_binds = tuple(f"{b}extra{i}" for i in range(len(extra_cols)))

    values: dict[str, Any] = {state_name: bindparam(target)}
    values.update({col: bindparam(x) for col, x in zip(extra_cols, extra_binds, strict=True)})
    stmt = update(tbl).where(key_col == key_bind, state_col.in_([bindparam(s) for s in sources]))
    if fenced:
        values[fence_name] = bindparam(f"{b}fence")
        stmt = stmt.where(fence_accepts(fence_col, f"{b}fence"))
    probe_cols = [state_col, fence_col] if fenced else [state_col]
    return _Shape(
        update=stmt.values(values),
        probe=select(*probe_cols).where(key_col == key_bind).with_for_update(),
        fixed={target: edge.target, **dict(zip(sources, edge.sources, strict=True))},
        key_bind=key_bind.key,
        fence_bind=f"{b}fence",
        extra_binds=extra_binds,
    )


def _check_states(states: Sequence[str]) -> tuple[str, ...]:
    if isinstance(states, str) or not states:
        raise ConfigurationError("states must be a non-empty ordered sequence of strings")
    out = tuple(states)
    for state in out:
        if not isinstance(state, str) or not state:
            raise ConfigurationError(f"states must be non-empty strings, got {state!r}")
    if len(set(out)) != len(out):
        raise ConfigurationError(f"states must be unique, got {list(out)}")
    return out


def _check_fence(fence: object) -> int | None:
    # bool is an int subclass: True would silently mean token 1.
    if fence is None:
        return None
    if isinstance(fence, bool) or not isinstance(fence, int):
        raise InvalidInputError(f"fence must be an int fencing token, got {fence!r}")
    return fence
