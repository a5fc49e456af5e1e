"""Where the ``idemq`` commands' logs go, and in what form (``--log-format text|json``).

On a terminal, ``text`` is rich's coloured layout; anywhere else (a file, a pipe, journald) it is
:class:`~idemq.observe.logs.TextFormatter`'s one plain line per record, never wrapped, so a
``grep`` finds whole records. ``json`` is one object per line everywhere. An expected error (an
idemq error) is one line in every form; a traceback only for an unexpected one, or with ``-v``.
"""

from __future__ import annotations

import logging
import sys

from rich.logging import RichHandler

from idemq.cli.commands import err_console
from idemq.errors import IdemqError
from idemq.observe.logs import JsonFormatter, TextFormatter

__all__ = ["LOG_FORMATS", "configure_logging"]

LOG_FORMATS = ("text", "json")

# Broker clients that log each connection failure they also raise (aiormq at ERROR, aio_pika's
# robust connection a "Reconnecting" line idemq's own retry makes untrue): idemq's one line says it.
# librdkafka logs a failed connect every 100 ms.
_QUIET_CLIENTS = ("aiormq", "aio_pika", "idemq.brokers.librdkafka")


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


def configure_logging(*, verbose: bool = False, log_format: str = "text") -> None:
    """Send the root logger's records to stderr in ``log_format`` (DEBUG with ``verbose``)."""
    handler: logging.Handler
    if log_format == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter(tracebacks=verbose))
    elif err_console.is_terminal:
        handler = RichHandler(console=err_console, show_path=False)
        if not verbose:
            handler.addFilter(_ExpectedErrorsOnOneLine())
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(TextFormatter(tracebacks=verbose))
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, handlers=[handler], force=True
    )
    for name in _QUIET_CLIENTS:
        # The client logs the failure it then raises; idemq logs it once, on one line.
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.CRITICAL)
