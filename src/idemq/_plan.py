"""The one runner of every sans-I/O plan in idemq: ``drive`` (sync) and ``adrive`` (async).

A plan is a generator that yields *steps* (a statement to run, a script to call, a handler to
invoke) and receives each step's reply; its return value is the plan's answer. The logic is
written once, without I/O; a shell supplies ``execute``, which carries out one step, with or
without ``await``. So the guard, the SQL and Redis stores and the lock cannot drift between their
sync and async forms: only ``execute`` differs.

``execute`` may raise. An error of the idemq tree (a translated driver failure) is thrown into
the plan at the step that caused it, so the plan can handle it (the lock's renewal loop rides out
an outage shorter than its TTL) or let it propagate; anything else propagates at once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

from idemq.errors import IdemqError

__all__ = ["Plan", "adrive", "drive"]

S = TypeVar("S")
T = TypeVar("T")

Plan = Generator[S, Any, T]
"""A plan yielding steps of type ``S`` and returning ``T``."""


def drive(plan: Plan[S, T], execute: Callable[[S], Any]) -> T:
    """Run ``plan`` to its end, carrying out each step with ``execute``; return its answer."""
    try:
        step = next(plan)
        while True:
            try:
                reply = execute(step)
            except IdemqError as exc:
                step = plan.throw(exc)
            else:
                step = plan.send(reply)
    except StopIteration as stop:
        result: T = stop.value
        return result


async def adrive(plan: Plan[S, T], execute: Callable[[S], Awaitable[Any]]) -> T:
    """:func:`drive` for an async shell: the same plan, each step awaited."""
    try:
        step = next(plan)
        while True:
            try:
                reply = await execute(step)
            except IdemqError as exc:
                step = plan.throw(exc)
            else:
                step = plan.send(reply)
    except StopIteration as stop:
        result: T = stop.value
        return result
