"""Where the worker runs its handlers: a thread pool, or the consuming thread itself.

With one thread (the default ``--concurrency 1``) a pool only adds a hand-off: the consuming
thread would wake a pool thread for every delivery and sleep until the next slot frees. Running
the handler inline does the same work in the same order, minus two thread switches per message.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

__all__ = ["InlineExecutor", "executor"]

P = ParamSpec("P")
T = TypeVar("T")


class InlineExecutor(Executor):
    """Runs each submitted call at once, in the caller's thread."""

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # as in a pool: the error lives in the future
            future.set_exception(exc)
        return future


def executor(threads: int, name: str) -> Executor:
    """A pool of ``threads`` threads named ``name``, or an :class:`InlineExecutor` for one."""
    if threads == 1:
        return InlineExecutor()
    return ThreadPoolExecutor(threads, thread_name_prefix=name)
