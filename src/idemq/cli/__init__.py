"""The ``idemq`` command (``idemq = "idemq.cli:main"``) and its exit codes.

:mod:`.parser` turns arguments into a call of one function of :mod:`.commands`, which calls the
library; no decision is made in either. Scripts can rely on the exit codes below.
"""

from __future__ import annotations

from idemq.cli.commands import (
    EXIT_ABORTED,
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_STORE,
    EXIT_USAGE,
)
from idemq.cli.parser import main

__all__ = [
    "EXIT_ABORTED",
    "EXIT_FAILED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_STORE",
    "EXIT_USAGE",
    "main",
]
