"""Where the ``idemq`` commands' logs go, and in what form (``--log-format text|json``).

On a terminal, ``text`` is rich's coloured layout (when rich is installed); anywhere else (a
file, a pipe, journald, an install without rich) it is
:class:`~idemq.observe.logs.TextFormatter`'s one plain line per record, never wrapped, so a
``grep`` finds whole records. ``json`` is one object per line everywhere. An expected error (an
idemq error) is one line in every form; a traceback only for an unexpected one, or with ``-v``.
"""

from __future__ import annotations

import logging
import sys

from idemq.cli.terminal import terminal_log_handler
from idemq.observe.logs import JsonFormatter, TextFormatter

__all__ = ["LOG_FORMATS", "configure_logging"]

LOG_FORMATS = ("text", "json")

# Broker clients that log each connection failure they also raise (aiormq at ERROR, aio_pika's
# robust connection a "Reconnecting" line idemq's own retry makes untrue): idemq's one line says it.
# librdkafka logs a failed connect every 100 ms.
_QUIET_CLIENTS = ("aiormq", "aio_pika", "idemq.brokers.librdkafka")


def configure_logging(*, verbose: bool = False, log_format: str = "text") -> None:
    """Send the root logger's records to stderr in ``log_format`` (DEBUG with ``verbose``)."""
    handler = terminal_log_handler(verbose=verbose) if log_format == "text" else None
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        formatter = JsonFormatter if log_format == "json" else TextFormatter
        handler.setFormatter(formatter(tracebacks=verbose))
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, handlers=[handler], force=True
    )
    for name in _QUIET_CLIENTS:
        # The client logs the failure it then raises; idemq logs it once, on one line.
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.CRITICAL)
