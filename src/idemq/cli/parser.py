"""The ``idemq`` command: argument parsing only; each command is a function of
:mod:`idemq.cli.commands`, which calls the library.

Exit codes are named constants (re-exported here); scripts can rely on them.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta

from idemq.cli.commands import (
    EXIT_FAILED,
    EXIT_STORE,
    EXIT_USAGE,
    cmd_chaos,
    cmd_demo,
    cmd_forget,
    cmd_id_new,
    cmd_id_parse,
    cmd_inspect,
    cmd_publish,
    cmd_purge,
    cmd_release,
    cmd_schema,
    cmd_stats,
    cmd_worker,
)
from idemq.cli.logs import LOG_FORMATS, configure_logging
from idemq.cli.outbox_commands import cmd_outbox_retry, cmd_relay
from idemq.cli.schema_commands import cmd_schema_upgrade
from idemq.cli.terminal import tell
from idemq.cli.url_options import ENV_RULE, add_url_option, argv_secrets_warning
from idemq.errors import (
    BrokerError,
    BrokerUnavailableError,
    ConfigurationError,
    IdemqError,
    InvalidInputError,
    StoreConfigurationError,
    StoreError,
)

__all__ = ["main"]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """``30s``, ``15m``, ``12h``, ``7d``, ``2w`` → a timedelta (for ``purge --older-than``)."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration like 7d, 12h, 30m: {text!r}")
    return timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])


def parse_header(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` → (key, value), for ``publish --header``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"a header is KEY=VALUE, got {text!r}")
    return key, value


# -- parser --------------------------------------------------------------------------------


def _add_log_format(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text: one plain line per record off a terminal; json: one object per line",
    )


def _add_store_naming(command: argparse.ArgumentParser) -> None:
    command.add_argument("--table", help="SQL store: dedup table (default message_idempotent)")
    command.add_argument("--prefix", help="Redis store: key prefix (default idemq)")


def _add_operator_commands(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``stats``, ``release`` and ``forget``: what on-call engineers run."""
    stats = add("stats", cmd_stats, "records by status, oldest, stuck leases, size of a store")
    add_url_option(stats, "--store", "SQLAlchemy URL or redis://")
    stats.add_argument("--json", action="store_true")
    stats.add_argument(
        "--outbox-table", default="idemq_outbox", help="outbox shown when the table exists"
    )
    _add_store_naming(stats)
    release = add("release", cmd_release, "free a stuck lease so the message can be retried")
    release.add_argument("id")
    add_url_option(release, "--store", "SQLAlchemy URL or redis://")
    release.add_argument("--consumer", help="whose record (needed if several hold the id)")
    release.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    release.add_argument("--json", action="store_true")
    _add_store_naming(release)
    forget = add("forget", cmd_forget, "forget a message: its next delivery runs again")
    forget.add_argument("id")
    add_url_option(forget, "--store", "SQLAlchemy URL or redis://")
    forget.add_argument("--consumer", default="default", help="whose record (default: default)")
    forget.add_argument(
        "--force", action="store_true", help="also a live lease (its worker may be mid-effect)"
    )
    forget.add_argument("--json", action="store_true")
    _add_store_naming(forget)


def _add_batch_flags(worker: argparse.ArgumentParser) -> None:
    worker.add_argument(
        "--batch-size",
        type=int,
        help="guard up to N deliveries per transaction; each is settled after its batch commits",
    )
    worker.add_argument(
        "--batch-wait-ms",
        type=int,
        default=50,
        help="how long a partial batch waits for more deliveries (default 50)",
    )


def _add_guard_mode(worker: argparse.ArgumentParser) -> None:
    """``--mode``, ``--lease-s`` and ``--expires-after``: how the worker's guard claims."""
    worker.add_argument(
        "--mode",
        choices=("transactional", "lease"),
        help="transactional (SQL default): the handler's writes share the dedup row's"
        " transaction (tx); lease (Redis's only mode): an effect outside the store's database,"
        " the handler gets tx=None and its claim is a lease renewed while it runs",
    )
    worker.add_argument(
        "--lease-s",
        type=_positive_s,
        metavar="S",
        help="lease mode: how long a claim is held unless renewed (default 30)",
    )
    worker.add_argument(
        "--expires-after",
        type=_positive_s,
        metavar="S",
        help="a message completed more than S seconds ago counts as new and runs again"
        " (default: records never expire; `idemq purge` removes old ones)",
    )


def _positive_s(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    # NaN and inf pass float(); neither is a lease or a window anyone means.
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return value


def _chaos_arguments(chaos: argparse.ArgumentParser) -> None:
    add_url_option(chaos, "--broker", "amqp://, kafka://, nats://, redis://, embedded://")
    add_url_option(chaos, "--store", "SQLAlchemy URL or redis://")
    chaos.add_argument("--messages", type=int, default=500, help="distinct messages (default 500)")
    chaos.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    chaos.add_argument(
        "--kill-every", type=float, default=2.0, help="SIGKILL a worker every S seconds (0: never)"
    )
    chaos.add_argument(
        "--slow-rate",
        type=float,
        default=0.02,
        help="share of handlers outlasting the broker timeout",
    )
    chaos.add_argument(
        "--partition-rate",
        type=float,
        default=0.01,
        help="share of publishes whose confirm is lost",
    )
    chaos.add_argument("--no-guard", action="store_true", help="same scenario without idemq")
    chaos.add_argument("--json", action="store_true", help="one JSON object on the last line")
    chaos.add_argument("--report", help="write a self-contained HTML report here")
    add_url_option(chaos, "--ledger", "order tables' database for a redis:// store", required=False)
    chaos.add_argument("--dir", help="where event files go (default: a temp dir)")
    chaos.add_argument("--timeout", type=float, default=300.0, help="stop after S seconds")
    chaos.add_argument("--seed", type=int, default=7)
    chaos.add_argument("--rate", type=float, default=0.0, help="messages/s (default: unpaced)")
    chaos.add_argument("--keep", action="store_true", help="keep tables, keys and queue")
    chaos.add_argument(
        "--two-hop",
        action="store_true",
        help="pay adds a ship message to the outbox; relays publish it; ship workers consume it",
    )
    chaos.add_argument(
        "--tune-broker",
        action="store_true",
        help="RabbitMQ < 3.12: shorten the server-wide consumer_timeout for the run (restored)",
    )
    chaos.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="spread the workers over N hosts (network namespaces, root only) and cut host 1"
        " off the network while it holds messages",
    )
    chaos.add_argument(
        "--cut-s", type=float, default=12.0, help="how long --hosts keeps host 1 cut off (12)"
    )


def _add_outbox_commands(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``relay`` and ``outbox retry``."""
    relay = add("relay", cmd_relay, "publish the outbox's committed rows, with confirms")
    add_url_option(relay, "--store", "SQLAlchemy URL of the outbox's database")
    add_url_option(relay, "--broker", "amqp://, kafka://, nats://, redis://, …")
    relay.add_argument("--outbox-table", default="idemq_outbox")
    relay.add_argument("--batch-size", type=int, default=100, help="rows per transaction")
    relay.add_argument(
        "--max-attempts", type=int, default=10, help="refusals before a row is dead (default 10)"
    )
    relay.add_argument(
        "--keep-sent-s", type=float, default=0.0, help="keep sent rows this long (default: delete)"
    )
    relay.add_argument("--create-schema", action="store_true", help="create missing tables first")
    _add_log_format(relay)
    outbox = add("outbox", lambda _: EXIT_USAGE, "outbox operations")
    outbox_sub = outbox.add_subparsers(dest="outbox_command", required=True, metavar="retry")
    retry = outbox_sub.add_parser(
        "retry", help="move a dead outbox row back to be published", epilog=ENV_RULE
    )
    retry.set_defaults(func=cmd_outbox_retry)
    retry.add_argument("id")
    add_url_option(retry, "--store", "SQLAlchemy URL of the outbox's database")
    retry.add_argument("--outbox-table", default="idemq_outbox")


def build_parser() -> argparse.ArgumentParser:  # noqa: PLR0915 (one flat list of commands)
    parser = argparse.ArgumentParser(
        prog="idemq",
        description="Exactly-once effects for at-least-once message consumers.",
        epilog=ENV_RULE,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, func: Callable[[argparse.Namespace], int], help_: str
    ) -> argparse.ArgumentParser:
        command = sub.add_parser(name, help=help_, description=help_, epilog=ENV_RULE)
        command.set_defaults(func=func)
        return command

    # The lab's two commands need the chaos extra (rich); their help says so before they refuse.
    demo = add(
        "demo",
        cmd_demo,
        "the three causes of duplicates, live, on SQLite (no servers; needs idemq[chaos])",
    )
    demo.add_argument("--orders", type=int, default=120, help="distinct messages (default 120)")
    demo.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    demo.add_argument("--no-guard", action="store_true", help="run without idemq, to compare")
    demo.add_argument(
        "--dir", help="where the queue and ledger files go, kept (default: a temp dir)"
    )
    demo.add_argument(
        "--keep", action="store_true", help="keep the temp dir with the queue and ledger files"
    )
    demo.add_argument("--json", action="store_true", help="one JSON object instead of tables")

    _chaos_arguments(
        add(
            "chaos",
            cmd_chaos,
            "inject the three causes of duplicates; check the ledger (needs idemq[chaos])",
        )
    )

    worker = add("worker", cmd_worker, "run MODULE:HANDLER behind the guard on a broker")
    worker.add_argument("handler", metavar="MODULE:HANDLER")
    add_url_option(
        worker,
        "--broker",
        "amqp://, kafka://, nats://, redis://, mqtt:// or embedded:///path/queue.db",
    )
    worker.add_argument("--queue", required=True, help="queue / topic / stream / subject")
    add_url_option(worker, "--store", "SQLAlchemy URL or redis://")
    worker.add_argument("--consumer", help="dedup scope (default: the queue name)")
    worker.add_argument("--concurrency", type=int, default=1)
    worker.add_argument("--prefetch", type=int)
    worker.add_argument(
        "--max-attempts",
        type=int,
        default=5,
        help="handler failures before dead-lettering (default 5)",
    )
    worker.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on this port (extra: metrics)"
    )
    _add_batch_flags(worker)
    _add_guard_mode(worker)
    worker.add_argument(
        "--relay", action="store_true", help="also relay the store's outbox to the broker"
    )
    worker.add_argument("--outbox-table", default="idemq_outbox")
    worker.add_argument(
        "--declare",
        choices=("auto", "never"),
        help="auto (default): use the queue/stream as it exists, create only what is missing;"
        " never: create nothing (RabbitMQ, NATS, Kafka, Redis Streams)",
    )
    worker.add_argument(
        "--dead-letter",
        metavar="NAME",
        help="dead-letter queue/subject/topic/stream (default <queue>.dlq)",
    )
    worker.add_argument(
        "--give-up-after",
        type=float,
        metavar="S",
        help="exit 4 after S seconds of broker outage (default: 30 at start-up, then never)",
    )
    worker.add_argument(
        "--log-error-text",
        action="store_true",
        help="log a failing handler's exception text and traceback (default: its class and"
        " where it was raised only, as the text may quote the payload)",
    )
    _add_log_format(worker)
    _add_store_naming(worker)

    _add_outbox_commands(add)

    ids = add("id", lambda _: EXIT_USAGE, "message ids: PREFIX_yyyyMMddHHmmssSSS_NODE_SEQ")
    id_sub = ids.add_subparsers(dest="id_command", required=True, metavar="new|parse")
    new = id_sub.add_parser("new", help="print fresh ids")
    new.set_defaults(func=cmd_id_new)
    new.add_argument("--prefix", required=True)
    new.add_argument("--node", required=True)
    new.add_argument("-n", type=int, default=1, help="how many (default 1)")
    new.add_argument("--sequence-digits", type=int, default=4)
    parse = id_sub.add_parser("parse", help="split an id into its parts (JSON)")
    parse.set_defaults(func=cmd_id_parse)
    parse.add_argument("id")

    inspect = add("inspect", cmd_inspect, "show what the store knows of a message id")
    inspect.add_argument("id")
    add_url_option(inspect, "--store", "SQLAlchemy URL or redis://")
    inspect.add_argument("--consumer", help="only this consumer's record")
    inspect.add_argument("--json", action="store_true")
    _add_store_naming(inspect)

    _add_operator_commands(add)

    purge = add("purge", cmd_purge, "delete processed records older than a duration")
    purge.add_argument("--older-than", type=parse_duration, required=True, help="e.g. 7d, 12h")
    add_url_option(purge, "--store", "SQLAlchemy URL or redis://")
    purge.add_argument(
        "--batch-size",
        type=int,
        default=1000,
        help="rows per transaction, so no long lock is held (default 1000)",
    )
    purge.add_argument("--json", action="store_true")
    _add_store_naming(purge)

    publish = add("publish", cmd_publish, "publish one message with a stamped id; print the id")
    publish.add_argument("body", metavar="BODY", help="the message body, or - to read stdin")
    add_url_option(
        publish,
        "--broker",
        "amqp://, kafka://, nats://, redis://, mqtt:// or embedded:///path/queue.db",
    )
    publish.add_argument("--queue", required=True)
    publish.add_argument("--id", help="message id (default: a fresh PREFIX_… id)")
    publish.add_argument("--prefix", default="MSG", help="prefix of stamped ids (default MSG)")
    publish.add_argument("--business-id")
    publish.add_argument(
        "--header", type=parse_header, action="append", default=[], metavar="KEY=VALUE"
    )
    publish.add_argument(
        "--attempts",
        type=int,
        default=3,
        help="tries when a confirm times out, always with the same id",
    )

    schema = add("schema", cmd_schema, "print the dedup table's DDL (or create it with --store)")
    schema.add_argument(
        "--dialect",
        choices=["postgresql", "mysql", "mariadb", "sqlite"],
        help="the DDL to print (default postgresql); with --store, the store's own dialect",
    )
    schema.add_argument("--table", default="message_idempotent")
    add_url_option(
        schema,
        "--store",
        "create the table in this database instead of printing",
        env_default=False,
    )
    schema.add_argument("--outbox-table", default="idemq_outbox", help="outbox tables' name")
    schema.add_argument("--no-outbox", action="store_true", help="only the dedup table")
    _add_schema_upgrade(schema)
    return parser


def _add_schema_upgrade(schema: argparse.ArgumentParser) -> None:
    """``schema upgrade``: ``idemq schema`` alone still prints (or creates) the tables."""
    schema_sub = schema.add_subparsers(dest="schema_command", metavar="upgrade")
    help_ = "bring tables of an older idemq to the current version in place (online DDL)"
    upgrade = schema_sub.add_parser("upgrade", help=help_, description=help_, epilog=ENV_RULE)
    upgrade.set_defaults(func=cmd_schema_upgrade)
    add_url_option(upgrade, "--store", "SQLAlchemy URL of the tables' database")
    upgrade.add_argument("--table", default="message_idempotent", help="the dedup table")
    upgrade.add_argument("--outbox-table", default="idemq_outbox", help="outbox tables' name")
    upgrade.add_argument("--no-outbox", action="store_true", help="only the dedup table")
    upgrade.add_argument(
        "--dry-run", action="store_true", help="print the statements, change nothing"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``idemq`` script."""
    args = build_parser().parse_args(argv)
    log_format = getattr(args, "log_format", "text")
    configure_logging(verbose=args.verbose, log_format=log_format)
    warning = argv_secrets_warning(args)
    if warning is not None:
        logging.getLogger("idemq.cli").warning("%s", warning)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except StoreConfigurationError as exc:  # before StoreError: the same settings fail again
        return _report(exc, "store refused the setup", EXIT_USAGE, log_format)
    except (ConfigurationError, InvalidInputError) as exc:
        return _report(exc, "error", EXIT_USAGE, log_format)
    except StoreError as exc:
        return _report(exc, "store error", EXIT_STORE, log_format)
    except BrokerUnavailableError as exc:
        return _report(exc, "broker unavailable", EXIT_STORE, log_format)
    except BrokerError as exc:  # e.g. a publish the broker did not route
        return _report(exc, "broker error", EXIT_STORE, log_format)
    except IdemqError as exc:
        return _report(exc, "error", EXIT_FAILED, log_format)


def _report(error: IdemqError, label: str, code: int, log_format: str) -> int:
    """One line on stderr saying what failed (a JSON record with ``--log-format json``)."""
    text = " ".join(str(error).split())  # one line, whatever the driver's message held
    if log_format == "json":
        logging.getLogger("idemq.cli").error(
            "%s: %s", label, text, extra={"idemq_error": type(error).__name__}
        )
    else:
        tell(text, label=label)
    return code


if __name__ == "__main__":
    sys.exit(main())
