"""The outbox's commands: ``idemq relay`` and ``idemq outbox retry ID`` (parsed in
:mod:`idemq.cli.parser`; the work is the library's)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType

from idemq.cli.commands import EXIT_NOT_FOUND, EXIT_OK
from idemq.cli.terminal import say, tell
from idemq.drivers.urls import mask_url

__all__ = ["cmd_outbox_retry", "cmd_relay"]

log = logging.getLogger("idemq.relay")


def cmd_relay(args: argparse.Namespace) -> int:
    """Relay until SIGTERM/SIGINT (the batch in flight is finished first)."""
    from idemq.outbox import Outbox, OutboxRelay  # noqa: PLC0415
    from idemq.stores.sql import SqlStore  # noqa: PLC0415

    store = SqlStore(args.store)
    outbox = Outbox(store, table=args.outbox_table)
    if args.create_schema:
        outbox.create_schema()
    relay = OutboxRelay(
        outbox,
        args.broker,
        batch_size=args.batch_size,
        max_attempts=args.max_attempts,
        keep_sent_s=args.keep_sent_s,
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %s: finishing the batch in flight, then exiting", signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    log.info("idemq relay: %s → %s", outbox.where, mask_url(args.broker))
    try:
        relay.run(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        relay.close()
        store.close()
    log.info("idemq relay stopped: published=%d dead=%d", relay.published_total, relay.dead_total)
    return EXIT_OK


def cmd_outbox_retry(args: argparse.Namespace) -> int:
    """Move a dead-lettered outbox row back so the relay publishes it again."""
    from idemq.outbox import Outbox, retry_dead  # noqa: PLC0415
    from idemq.stores.sql import SqlStore  # noqa: PLC0415

    store = SqlStore(args.store)
    try:
        moved = retry_dead(Outbox(store, table=args.outbox_table), args.id)
    finally:
        store.close()
    if not moved:
        tell(f"no dead outbox row {args.id!r}")
        return EXIT_NOT_FOUND
    say(f"{args.id!r} is back in the outbox: the relay publishes it next")
    return EXIT_OK
