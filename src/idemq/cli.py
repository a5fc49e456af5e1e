"""The ``idemq`` command: argument parsing only; every command calls the library.

Exit codes are named below; scripts can rely on them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.prompt import Confirm
from rich.table import Table

from idemq import admin
from idemq.admin import record_dict
from idemq.errors import ConfigurationError, IdemqError, InvalidInputError, StoreError

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

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and the answer is "no" (demo invariant violated, …)
EXIT_USAGE = 2  # bad arguments or configuration (argparse uses 2 as well)
EXIT_NOT_FOUND = 3  # inspect: no such message id
EXIT_STORE = 4  # the store could not be reached or failed
EXIT_ABORTED = 5  # release: the operator said no (or no TTY to ask on and no --yes)
EXIT_REFUSED = 6  # release: the record is PROCESSED (deleting it would let it run twice)

console = Console()
err_console = Console(stderr=True)

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """``30s``, ``15m``, ``12h``, ``7d``, ``2w`` → a timedelta (for ``purge --older-than``)."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration like 7d, 12h, 30m: {text!r}")
    return timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str, ensure_ascii=False))


def _record_table(data: dict[str, Any]) -> Table:
    table = Table(title=f"{data['message_id']} ({data['consumer']})", show_header=False)
    for key, value in data.items():
        table.add_row(key, json.dumps(value, ensure_ascii=False) if key == "result" else str(value))
    return table


# -- commands ------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from idemq.demo import (  # noqa: PLC0415
        DemoConfig,
        default_directory,
        intro,
        render_report,
        run_demo,
    )

    directory = Path(args.dir) if args.dir else default_directory()
    directory.mkdir(parents=True, exist_ok=True)
    config = DemoConfig(
        directory, orders=args.orders, workers=args.workers, guard=not args.no_guard
    )
    if not args.json:
        console.rule("[bold]idemq demo[/bold]: exactly-once payments on an at-least-once queue")
        console.print(intro(config))
    report = run_demo(config, progress=(lambda _: None) if args.json else console.print)
    if args.json:
        _print_json({**report.__dict__, "ok": report.ok})
    else:
        render_report(report, console)
    return EXIT_OK if report.ok else EXIT_FAILED


def cmd_chaos(args: argparse.Namespace) -> int:
    from idemq.chaos import ChaosConfig, run_chaos, write_report  # noqa: PLC0415
    from idemq.chaos.console import render_result, run_with_progress  # noqa: PLC0415

    config = ChaosConfig(
        broker_url=args.broker,
        store_url=args.store,
        messages=args.messages,
        workers=args.workers,
        kill_every_s=args.kill_every,
        slow_rate=args.slow_rate,
        partition_rate=args.partition_rate,
        guard=not args.no_guard,
        directory=Path(args.dir) if args.dir else None,
        ledger_url=args.ledger,
        timeout_s=args.timeout,
        seed=args.seed,
        keep=args.keep,
        rate_per_s=args.rate,
        tune_broker=args.tune_broker,
    )
    if args.json:
        result = run_chaos(config)
    else:
        result = run_with_progress(config, console)
        render_result(result, console)
    if args.report:
        path = write_report(result, args.report)
        if not args.json:
            console.print(f"report: {path}")
    if args.json:
        print(json.dumps(result.to_json(), default=str))  # one line, the last one
    return EXIT_OK if result.ok else EXIT_FAILED


def cmd_worker(args: argparse.Namespace) -> int:
    from idemq.worker import run_worker  # noqa: PLC0415

    # MODULE:HANDLER is usually the user's own code in the current directory; a console script's
    # sys.path does not include it (uvicorn and celery add it the same way).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    stats = run_worker(
        args.handler,
        broker_url=args.broker,
        queue=args.queue,
        store_url=args.store,
        consumer=args.consumer,
        concurrency=args.concurrency,
        prefetch=args.prefetch,
        max_attempts=args.max_attempts,
        metrics_port=args.metrics_port,
        batch_size=args.batch_size,
        batch_wait_ms=args.batch_wait_ms,
    )
    err_console.print(f"idemq worker stopped: {stats}")
    return EXIT_OK


def cmd_id_new(args: argparse.Namespace) -> int:
    from idemq.ids import generate_ids  # noqa: PLC0415

    for message_id in generate_ids(
        args.prefix, args.node, args.n, sequence_digits=args.sequence_digits
    ):
        print(message_id)
    return EXIT_OK


def cmd_id_parse(args: argparse.Namespace) -> int:
    from idemq.ids import parse_message_id  # noqa: PLC0415

    _print_json(parse_message_id(args.id).to_dict())
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    store = admin.open_store_for(args.store, table=args.table, prefix=args.prefix)
    try:
        records = admin.find_records(store, args.id, args.consumer)
    finally:
        store.close()
    if args.json:
        _print_json(records)
    elif records:
        for record in records:
            console.print(_record_table(record))
    else:
        err_console.print(f"no record of message id {args.id!r}")
    return EXIT_OK if records else EXIT_NOT_FOUND


def cmd_stats(args: argparse.Namespace) -> int:
    store = admin.open_store_for(args.store, table=args.table, prefix=args.prefix)
    try:
        report = admin.stats_report(store)
    finally:
        store.close()
    if args.json:
        _print_json(report)
        return EXIT_OK
    table = Table(title=f"idemq store {report['store']}", show_header=False)
    table.add_row("processing", str(report["records"]["processing"]))
    table.add_row("processed", str(report["records"]["processed"]))
    table.add_row("stuck leases (expired, not completed)", str(report["stuck_leases"]))
    table.add_row(
        "oldest processing",
        f"{report['oldest_processing']} ({report['oldest_processing_age_s']} s ago)"
        if report["oldest_processing"]
        else "-",
    )
    table.add_row("oldest processed", str(report["oldest_processed"] or "-"))
    size = report["size_bytes"]
    table.add_row("size", f"{size:,} bytes ({report['size_method']})" if size is not None else "?")
    console.print(table)
    if report["stuck_records"]:
        stuck = Table(title="oldest stuck leases (free one with `idemq release ID`)")
        columns = ("consumer", "message_id", "created_time", "attempts", "owner")
        for column in columns:
            stuck.add_column(column)
        for record in report["stuck_records"]:
            stuck.add_row(*(str(record[c]) for c in columns))
        console.print(stuck)
    return EXIT_OK


def cmd_release(args: argparse.Namespace) -> int:
    store = admin.open_store_for(args.store, table=args.table, prefix=args.prefix)
    try:
        plan = admin.plan_release(store, args.id, args.consumer)
        if plan.verdict is admin.ReleaseVerdict.NOT_FOUND:
            err_console.print(f"no record of message id {args.id!r}")
            return EXIT_NOT_FOUND
        if plan.verdict is admin.ReleaseVerdict.AMBIGUOUS:
            names = ", ".join(r.consumer for r in plan.records)
            err_console.print(
                f"several consumers hold {args.id!r} in progress ({names}): "
                "name one with --consumer"
            )
            return EXIT_USAGE
        if plan.verdict is admin.ReleaseVerdict.PROCESSED:
            err_console.print(
                f"refusing: {args.id!r} is PROCESSED; deleting it would let it run twice"
            )
            return EXIT_REFUSED
        if not args.json:
            console.print(_record_table(record_dict(plan.record)))
        if plan.lease_live:
            err_console.print(
                "[yellow]warning:[/yellow] the lease has not expired: its worker "
                "may still be running, and another may now run it concurrently"
            )
        if not args.yes:
            if not sys.stdin.isatty():
                err_console.print("not a terminal: pass --yes to release without asking")
                return EXIT_ABORTED
            if not Confirm.ask(f"release {args.id!r} ({plan.record.consumer})?", console=console):
                return EXIT_ABORTED
        released = admin.release(store, plan.record)
    finally:
        store.close()
    if args.json:
        _print_json({"message_id": args.id, "consumer": plan.record.consumer, "released": released})
    elif released:
        console.print(f"released {args.id!r} ({plan.record.consumer}): it can be retried now")
    else:
        err_console.print(f"{args.id!r} was completed or released meanwhile: nothing done")
    return EXIT_OK if released else EXIT_REFUSED


def cmd_purge(args: argparse.Namespace) -> int:
    from idemq.stores import open_store  # noqa: PLC0415

    store = open_store(args.store)
    try:
        deleted = store.purge(args.older_than, batch_size=args.batch_size)
    finally:
        store.close()
    if args.json:
        _print_json({"deleted": deleted})
    else:
        console.print(f"deleted {deleted} processed records older than {args.older_than}")
    return EXIT_OK


def parse_header(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` → (key, value), for ``publish --header``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"a header is KEY=VALUE, got {text!r}")
    return key, value


def cmd_publish(args: argparse.Namespace) -> int:
    from idemq.publish import publish  # noqa: PLC0415

    body = sys.stdin.buffer.read() if args.body == "-" else args.body.encode()
    message_id = publish(
        args.broker,
        args.queue,
        body,
        message_id=args.id,
        business_id=args.business_id,
        headers=dict(args.header),
        prefix=args.prefix,
        attempts=args.attempts,
    )
    print(message_id)
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    from idemq.stores.sql import SqlStore, schema_sql  # noqa: PLC0415

    if args.store:
        store = SqlStore(args.store, table=args.table)
        try:
            store.create_schema()
        finally:
            store.close()
        err_console.print(f"created (if missing) table {args.table} in {store.where}")
        return EXIT_OK
    print(schema_sql(args.dialect, table=args.table), end="")
    return EXIT_OK


# -- parser --------------------------------------------------------------------------------


def _add_store_naming(command: argparse.ArgumentParser) -> None:
    command.add_argument("--table", help="SQL store: dedup table (default message_idempotent)")
    command.add_argument("--prefix", help="Redis store: key prefix (default idemq)")


def _add_operator_commands(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``stats`` and ``release``: what on-call engineers run (see README "Operations")."""
    stats = add("stats", cmd_stats, "records by status, oldest, stuck leases, size of a store")
    stats.add_argument("--store", required=True, help="SQLAlchemy URL or redis://")
    stats.add_argument("--json", action="store_true")
    _add_store_naming(stats)
    release = add("release", cmd_release, "free a stuck lease so the message can be retried")
    release.add_argument("id")
    release.add_argument("--store", required=True, help="SQLAlchemy URL or redis://")
    release.add_argument("--consumer", help="whose record (needed if several hold the id)")
    release.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    release.add_argument("--json", action="store_true")
    _add_store_naming(release)


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


def _chaos_arguments(chaos: argparse.ArgumentParser) -> None:
    chaos.add_argument(
        "--broker", required=True, help="amqp://, kafka://, nats://, redis://, embedded://"
    )
    chaos.add_argument("--store", required=True, help="SQLAlchemy URL or redis://")
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
    chaos.add_argument("--ledger", help="order tables' database for a redis:// store")
    chaos.add_argument("--dir", help="where event files go (default: a temp dir)")
    chaos.add_argument("--timeout", type=float, default=300.0, help="stop after S seconds")
    chaos.add_argument("--seed", type=int, default=7)
    chaos.add_argument("--rate", type=float, default=0.0, help="messages/s (default: unpaced)")
    chaos.add_argument("--keep", action="store_true", help="keep tables, keys and queue")
    chaos.add_argument(
        "--tune-broker",
        action="store_true",
        help="RabbitMQ < 3.12: shorten the server-wide consumer_timeout for the run (restored)",
    )


def build_parser() -> argparse.ArgumentParser:  # noqa: PLR0915 (one flat list of commands)
    parser = argparse.ArgumentParser(
        prog="idemq", description="Exactly-once effects for at-least-once message consumers."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, func: Callable[[argparse.Namespace], int], help_: str
    ) -> argparse.ArgumentParser:
        command = sub.add_parser(name, help=help_, description=help_)
        command.set_defaults(func=func)
        return command

    demo = add("demo", cmd_demo, "the three causes of duplicates, live, on SQLite (no servers)")
    demo.add_argument("--orders", type=int, default=120, help="distinct messages (default 120)")
    demo.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    demo.add_argument("--no-guard", action="store_true", help="run without idemq, to compare")
    demo.add_argument("--dir", help="where the queue and ledger files go (default: a temp dir)")
    demo.add_argument("--json", action="store_true", help="one JSON object instead of tables")

    _chaos_arguments(
        add("chaos", cmd_chaos, "inject the three causes of duplicates; check the ledger")
    )

    worker = add("worker", cmd_worker, "run MODULE:HANDLER behind the guard on a broker")
    worker.add_argument("handler", metavar="MODULE:HANDLER")
    worker.add_argument(
        "--broker",
        required=True,
        help="amqp://, kafka://, nats://, redis://, mqtt:// or embedded:///path/queue.db",
    )
    worker.add_argument("--queue", required=True, help="queue / topic / stream / subject")
    worker.add_argument("--store", required=True, help="SQLAlchemy URL or redis://")
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
    inspect.add_argument("--store", required=True, help="SQLAlchemy URL or redis://")
    inspect.add_argument("--consumer", help="only this consumer's record")
    inspect.add_argument("--json", action="store_true")
    _add_store_naming(inspect)

    _add_operator_commands(add)

    purge = add("purge", cmd_purge, "delete processed records older than a duration")
    purge.add_argument("--older-than", type=parse_duration, required=True, help="e.g. 7d, 12h")
    purge.add_argument("--store", required=True, help="SQLAlchemy URL or redis://")
    purge.add_argument(
        "--batch-size",
        type=int,
        default=1000,
        help="rows per transaction, so no long lock is held (default 1000)",
    )
    purge.add_argument("--json", action="store_true")

    publish = add("publish", cmd_publish, "publish one message with a stamped id; print the id")
    publish.add_argument("body", metavar="BODY", help="the message body, or - to read stdin")
    publish.add_argument(
        "--broker",
        required=True,
        help="amqp://, kafka://, nats://, redis://, mqtt:// or embedded:///path/queue.db",
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
        "--dialect", choices=["postgresql", "mysql", "mariadb", "sqlite"], default="postgresql"
    )
    schema.add_argument("--table", default="message_idempotent")
    schema.add_argument("--store", help="create the table in this database instead of printing")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``idemq`` script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=err_console, show_path=False)],
    )
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ConfigurationError, InvalidInputError) as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        return EXIT_USAGE
    except StoreError as exc:
        err_console.print(f"[red]store error:[/red] {exc}")
        return EXIT_STORE
    except IdemqError as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
