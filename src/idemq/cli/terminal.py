"""Where the ``idemq`` commands print, and in what form: rich's coloured tables, prompts and log
layout when ``rich`` is installed (the ``chaos`` extra brings it), plain lines otherwise.

``rich`` is not a dependency of idemq itself: a worker in a container logs to a pipe and needs no
colours, so ``idemq worker`` and the store commands work the same without it. Only ``idemq
chaos`` and ``idemq demo`` draw live progress and need it (:func:`lab_console`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from idemq.drivers.extras import missing_extra
from idemq.errors import IdemqError

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "confirm",
    "lab_console",
    "say",
    "show_table",
    "tell",
    "terminal_log_handler",
]

try:
    from rich.console import Console as _RichConsole
    from rich.markup import escape
    from rich.prompt import Confirm
    from rich.table import Table
except ImportError:  # the core install: plain text below
    _console: Console | None = None
    _err_console: Console | None = None
else:
    _console = _RichConsole()
    # soft_wrap: a line longer than the terminal (or than 80 columns, off a terminal) is not cut
    # in two, so an id or a URL in it stays greppable.
    _err_console = _RichConsole(stderr=True, soft_wrap=True)


def lab_console(command: str) -> Console:
    """The stdout console of ``idemq chaos`` / ``idemq demo``, or the error naming the extra."""
    try:
        from rich.console import Console  # noqa: PLC0415
    except ImportError as error:
        raise missing_extra(command, "chaos", error) from error
    return Console()


def say(text: str) -> None:
    """One line of a command's answer, on stdout."""
    if _console is None:
        print(text)
    else:
        _console.print(escape(text))


def tell(text: str, *, label: str | None = None, colour: str = "red") -> None:
    """One line for the operator on stderr, ``label:`` first (in ``colour`` on a terminal)."""
    if _err_console is None:
        print(text if label is None else f"{label}: {text}", file=sys.stderr)
    elif label is None:
        _err_console.print(escape(text))
    else:
        _err_console.print(f"[{colour}]{escape(label)}:[/{colour}] {escape(text)}")


def show_table(
    title: str, rows: Sequence[Sequence[str]], *, columns: Sequence[str] | None = None
) -> None:
    """A titled table on stdout; without ``columns`` a two-column key/value table, no header."""
    if _console is not None:
        table = Table(title=escape(title), show_header=columns is not None)
        for column in columns or ():
            table.add_column(escape(column))
        for row in rows:
            table.add_row(*(escape(cell) for cell in row))
        _console.print(table)
        return
    lines = [list(columns)] if columns else []
    lines += [list(row) for row in rows]
    widths = [max(map(len, cells)) for cells in zip(*lines, strict=True)]
    print(title)
    for line in lines:
        cells = (cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        print("  ".join(cells).rstrip())


def confirm(question: str) -> bool:
    """Ask ``question`` on the terminal until the answer is yes or no."""
    if _console is not None:
        return Confirm.ask(escape(question), console=_console)
    while True:
        answer = input(f"{question} [y/n]: ").strip().lower()
        if answer in ("y", "yes", "n", "no"):
            return answer.startswith("y")


class _ExpectedErrorsOnOneLine(logging.Filter):
    """For rich's handler: an idemq error's class and text join the message, without traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, IdemqError):
            record.msg = f"{record.getMessage()}: {type(error).__name__}: {error}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def terminal_log_handler(*, verbose: bool) -> logging.Handler | None:
    """rich's coloured log layout on stderr, or ``None`` where plain lines are due (stderr is
    not a terminal, or rich is not installed)."""
    if _err_console is None or not _err_console.is_terminal:
        return None
    from rich.logging import RichHandler  # noqa: PLC0415

    handler = RichHandler(console=_err_console, show_path=False)
    if not verbose:
        handler.addFilter(_ExpectedErrorsOnOneLine())
    return handler
